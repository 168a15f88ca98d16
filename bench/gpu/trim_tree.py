#!/usr/bin/env python3
"""Copy the materialized, patched llama.cpp tree into a small build-only tree.

The device machine gets the working tree plus carried paths (64 MiB in all), so
the CUDA build there uses a trimmed copy of vendor/llama.cpp passed in with
DREAMSTAGE_LLAMA_TREE. Kept: the top-level CMakeLists.txt, LICENSE, licenses/,
cmake/, include/, src/, vendor/ (the top-level CMakeLists adds it
unconditionally) and ggml/ (CMakeLists.txt, cmake/, include/, and src/ without
the other backends' directories: ggml-cpu, ggml-cuda and ggml-rpc stay, with every file at
the top of ggml/src), plus the stamp, which the top-level CMakeLists checks
against vendor/pin.json and vendor/patches, and tools/rpc (dreamstage-rpc-server's source).
No .git, docs, tests or other tools.
--server adds what llama-server needs (common/, tools/server, tools/mtmd, the UI's
build files without its web sources, scripts/ui-assets.cmake) and a tools/CMakeLists.txt
that adds only those, for bench/gpu/llama_server.sh.

Usage: bench/gpu/trim_tree.py [--src vendor/llama.cpp] [--dest .gpu/llama.cpp] [--server]
Refuses (exit 2) a source whose stamp does not match the current pin and patches:
run vendor/materialize.py first.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "vendor"))
import materialize  # noqa: E402

TOP_FILES = ["CMakeLists.txt", "LICENSE", materialize.STAMP_NAME]
TOP_DIRS = ["cmake", "include", "src", "vendor", "licenses"]
GGML_DIRS = ["cmake", "include"]
GGML_BACKENDS = {"ggml-cpu", "ggml-cuda", "ggml-rpc"}


SERVER_TOOLS = """llama_add_compile_flags()
add_subdirectory(mtmd)
add_subdirectory(ui)
add_subdirectory(server)
"""


def add_server(src: Path, dest: Path) -> None:
    """llama-server's sources on top of a trimmed tree (see the module docstring)."""
    ignore = shutil.ignore_patterns(".git", "__pycache__")
    shutil.copytree(src / "common", dest / "common", ignore=ignore)
    for name in ("server", "mtmd"):
        shutil.copytree(src / "tools" / name, dest / "tools" / name, ignore=ignore)
    shutil.copytree(src / "tools" / "ui", dest / "tools" / "ui",
                    ignore=shutil.ignore_patterns(".git", "src", "tests", "node_modules"))
    (dest / "scripts").mkdir(exist_ok=True)
    shutil.copy2(src / "scripts" / "ui-assets.cmake", dest / "scripts" / "ui-assets.cmake")
    (dest / "tools" / "CMakeLists.txt").write_text(SERVER_TOOLS)


def trim(src: Path, dest: Path, server: bool = False) -> int:
    if materialize.read_stamp(src) != materialize.expected_stamp(materialize.load_pin()):
        print(f"[trim_tree] {src}: stamp does not match vendor/pin.json + vendor/patches; "
              "run python3 vendor/materialize.py", file=sys.stderr)
        return 2
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    ignore = shutil.ignore_patterns(".git", "__pycache__")
    for name in TOP_FILES:
        shutil.copy2(src / name, dest / name)
    for name in TOP_DIRS:
        shutil.copytree(src / name, dest / name, ignore=ignore)
    (dest / "ggml").mkdir()
    shutil.copy2(src / "ggml" / "CMakeLists.txt", dest / "ggml" / "CMakeLists.txt")
    for name in GGML_DIRS:
        shutil.copytree(src / "ggml" / name, dest / "ggml" / name, ignore=ignore)
    (dest / "ggml" / "src").mkdir()
    for entry in (src / "ggml" / "src").iterdir():
        if entry.is_file():
            shutil.copy2(entry, dest / "ggml" / "src" / entry.name)
        elif entry.name in GGML_BACKENDS:
            shutil.copytree(entry, dest / "ggml" / "src" / entry.name, ignore=ignore)
    # dreamstage-rpc-server's source (CMakeLists.txt names the file; tools/ is not added)
    shutil.copytree(src / "tools" / "rpc", dest / "tools" / "rpc", ignore=ignore)
    if server:
        add_server(src, dest)
    if materialize.read_stamp(dest) != materialize.read_stamp(src):
        print("[trim_tree] the copied stamp differs from the source's", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    print(f"[trim_tree] {dest}: {size / 2**20:.1f} MiB")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, default=ROOT / "vendor" / "llama.cpp")
    ap.add_argument("--dest", type=Path, default=ROOT / ".gpu" / "llama.cpp")
    ap.add_argument("--server", action="store_true", help="add llama-server's sources")
    a = ap.parse_args()
    return trim(a.src.resolve(), a.dest.resolve(), a.server)


if __name__ == "__main__":
    sys.exit(main())
