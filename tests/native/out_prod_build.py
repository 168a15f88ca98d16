"""Compile tests/native/out_prod_check.cpp against our built ggml libraries.

Shared by tests/test_out_prod_native.py and bench/bench_out_prod.py. The headers
come from the materialized tree (DREAMSTAGE_LLAMA_TREE, else vendor/llama.cpp),
the libraries from dreamstage.native.lib_dir() (LLAMA_CPP_LIB_PATH, else the
package's lib/), with that directory as RUNPATH.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = Path(__file__).resolve().parent / "out_prod_check.cpp"


def ggml_include_dir() -> Path:
    tree = os.environ.get("DREAMSTAGE_LLAMA_TREE") or str(ROOT / "vendor" / "llama.cpp")
    return Path(tree).resolve() / "ggml" / "include"


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def build_out_prod_check(out: Path) -> Path:
    """Build the checker into `out`; raises CalledProcessError with the compiler's output."""
    from dreamstage import native  # imported after any env set-up by the caller

    lib = native.lib_dir()
    cxx = compiler()
    if cxx is None:
        raise FileNotFoundError("no C++ compiler (set CXX)")
    cmd = [cxx, "-O2", "-std=c++17", str(SOURCE), f"-I{ggml_include_dir()}", f"-L{lib}",
           "-lggml", "-lggml-base", f"-Wl,-rpath,{lib}", "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out
