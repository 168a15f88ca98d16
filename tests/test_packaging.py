"""The installed tree: `import llama_cpp` alone binds our libllama, one file per
library, and the package's dependencies cover what the runtime needs.

These check the install the build made (a wheel's or dev.sh's editable one,
laid out by the same CMake install rules), so they look the libraries up the
way a user's process would: without LLAMA_CPP_LIB_PATH.
"""
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _plain_env() -> dict:
    env = dict(os.environ)
    env.pop("LLAMA_CPP_LIB_PATH", None)
    return env


def _installed_lib_dir() -> Path:
    out = subprocess.run([sys.executable, "-c", "from dreamstage import native; print(native.lib_dir())"],
                         capture_output=True, text=True, env=_plain_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    return Path(out.stdout.strip())


PLAIN_IMPORT = r"""
import json, sys
from llama_cpp import Llama
import llama_cpp
llm = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, verbose=False)
toks = llm.tokenize(b"The moon base", add_bos=False)
llm.eval(toks)
lib = llama_cpp.llama_cpp._lib
print(json.dumps({"lib": lib._name, "ours": hasattr(lib, "dream_build_info"), "n_tokens": llm.n_tokens}))
llm.close()
"""


def test_plain_llama_cpp_import_loads_a_model_with_our_libllama(tiny_model_path):
    # Nothing from dreamstage is imported first: this is how the README's
    # llama_cpp.Llama(lora_path=...) is used.
    r = subprocess.run([sys.executable, "-c", PLAIN_IMPORT, str(tiny_model_path)],
                       capture_output=True, text=True, env=_plain_env(), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["ours"], f"{got['lib']} lacks dream_build_info: another llama.cpp build was loaded"
    assert Path(got["lib"]).resolve().parent == _installed_lib_dir()
    assert got["n_tokens"] >= 2


def test_each_library_is_one_file():
    d = _installed_lib_dir()
    names = sorted(p.name for p in d.iterdir() if ".so" in p.name or p.suffix == ".dylib")
    assert "libllama.so" in names and "libggml.so" in names, names
    versioned = [n for n in names if re.search(r"\.so\.\d", n)]
    assert versioned == [], f"versioned copies in {d}: {versioned}"
    assert not any(p.is_symlink() for p in d.iterdir())


def _names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r.strip(), maxsplit=1)[0].lower().replace("_", "-")
            for r in reqs if r.strip() and not r.lstrip().startswith("#")}


def test_runtime_requirements_are_the_package_dependencies():
    # dev.sh installs requirements/runtime.txt (pinned); `pip install` reads
    # pyproject's dependencies. A package dev.sh pins that pyproject does not
    # bring (itself or as a dependency of one it lists) is a plain pip install
    # that fails at import; one pyproject lists that dev.sh does not pin is a
    # dev environment that differs from users'.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = _names(pyproject["project"]["dependencies"])
    runtime = _names((ROOT / "requirements" / "runtime.txt").read_text().splitlines())
    assert deps <= runtime, f"not pinned in requirements/runtime.txt: {sorted(deps - runtime)}"
    brought = set(deps)
    for d in deps:
        brought |= _names(importlib.metadata.requires(d) or [])
    assert runtime <= brought, f"pinned for dev.sh but not brought by pyproject: {sorted(runtime - brought)}"
