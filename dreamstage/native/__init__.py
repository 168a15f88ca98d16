"""Loading our libllama and checking it is ours: built from the pin, with the
receipt layout that dreamstage.native.dream_h mirrors.

Exactly one libllama exists in a dreamstage process: ours, built from the
pinned, patched tree. llama-cpp-python's pure-Python package (the `llama_cpp`
mirror of llama.h, from the same pinned sdist, never built natively) is
installed by our build with our libraries in its own `llama_cpp/lib/`, so a
plain `import llama_cpp` binds them too. LLAMA_CPP_LIB_PATH (llama-cpp-python's
own variable, read by both) points both at a prebuilt directory instead.
"""
from __future__ import annotations

import ctypes
import importlib.util
import json
import sys
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

from dreamstage import environment
from dreamstage.native import dream_h

_PKG = Path(__file__).resolve().parents[1]   # the dreamstage package
# Held around llama.cpp's model and adapter loaders: both read the process-wide backend and device registry,
# and servers in one process (the tests' leader and followers) load at the same time.
LOAD_LOCK = threading.Lock()


class NativeLibraryError(RuntimeError):
    """The native library is missing, foreign, or built from another pin."""


def _pin() -> dict:
    # The pin travels inside the package (wheels) and in vendor/ (source trees).
    for p in (_PKG / "pin.json", _PKG.parent / "vendor" / "pin.json"):
        if p.is_file():
            return json.loads(p.read_text())
    raise NativeLibraryError("pin.json not found beside the package or in vendor/")


def lib_dir() -> Path:
    """Directory holding our libllama.so and the ggml libraries.

    LLAMA_CPP_LIB_PATH when set; else llama_cpp/lib/, where wheels and editable
    installs put them; else dreamstage/lib/ (a plain `cmake --install`, which
    then needs LLAMA_CPP_LIB_PATH for llama_cpp to load it too).
    """
    env = environment.get("LLAMA_CPP_LIB_PATH")
    candidates = [Path(env)] if env else []
    # Located without importing llama_cpp: importing it loads a library.
    spec = importlib.util.find_spec("llama_cpp")
    if not env and spec is not None and spec.submodule_search_locations:
        candidates.append(Path(list(spec.submodule_search_locations)[0]) / "lib")
    if not env:
        candidates.append(_PKG / "lib")
    for c in candidates:
        if (c / "libllama.so").is_file() or (c / "libllama.dylib").is_file():
            return c.resolve()
    raise NativeLibraryError(
        "dreamstage's libllama was not found (looked in " + ", ".join(str(c) for c in candidates)
        + "); build it with `./dev.sh build` or `pip install` the checkout")


def _shared_libstdcxx_first(d: Path) -> None:
    """Put the system's libstdc++ in the process's global symbol scope before a
    CUDA build's libraries load. libggml-cuda.so, as the CUDA toolchain links
    it, holds a static libstdc++ of its own and exports it (no DT_NEEDED
    libstdc++.so.6); loaded into the global scope by llama_cpp, that copy
    served libllama's std::regex, and the BPE tokenizer crashed in the model
    load whenever numpy (which loads the shared libstdc++) had been imported
    first (seen on the H200: docs/architecture/gpu.md, "One libstdc++"). With the
    shared library global first, every library binds to it, as with
    LD_PRELOAD=libstdc++.so.6. CPU builds link the shared one already."""
    if sys.platform != "linux" or not (d / "libggml-cuda.so").is_file():
        return
    try:
        ctypes.CDLL("libstdc++.so.6", mode=ctypes.RTLD_GLOBAL)
    except OSError:
        pass    # no shared libstdc++ to prefer: the libraries load as they link


@lru_cache(maxsize=1)
def llama_cpp():
    """The llama_cpp (llama-cpp-python) module, bound to our libllama."""
    d = lib_dir()
    already = sys.modules.get("llama_cpp.llama_cpp")
    if already is not None:
        loaded = Path(getattr(already, "_base_path", "")).resolve()
        if loaded != d:
            raise NativeLibraryError(
                f"llama_cpp was imported before dreamstage and loaded libllama from {loaded}, not {d}")
    _shared_libstdcxx_first(d)
    try:
        import llama_cpp as mod
    except (OSError, RuntimeError) as e:
        raise NativeLibraryError(f"could not load libllama from {d}: {e}") from e
    lib_path = Path(mod.llama_cpp._lib._name).resolve()
    if lib_path.parent != d:
        raise NativeLibraryError(f"llama_cpp loaded {lib_path}, not dreamstage's {d}: "
                                 f"set LLAMA_CPP_LIB_PATH={d}")
    _check_identity(mod.llama_cpp._lib, lib_path)
    return mod


def _check_identity(lib: ctypes.CDLL, path: Path) -> None:
    try:
        fn = lib.dream_build_info
    except AttributeError:
        raise NativeLibraryError(
            f"{path} is not dreamstage's libllama (no dream_build_info); "
            "another llama.cpp build is on the path") from None
    fn.restype = ctypes.c_char_p
    info = parse_build_info(fn().decode())
    pin = _pin()
    if info.get("llama-cpp-python") != pin["version"] or info.get("upstream") != pin["upstream_commit"]:
        raise NativeLibraryError(
            f"{path} was built from llama-cpp-python {info.get('llama-cpp-python')} "
            f"(upstream {info.get('upstream')}), but this package pins {pin['version']} "
            f"(upstream {pin['upstream_commit']}); rebuild with `./dev.sh build`")


def parse_build_info(s: str) -> dict:
    parts = s.split(";")
    if not parts or parts[0] != "dreamstage":
        raise NativeLibraryError(f"unexpected build identity {s!r}")
    out: dict[str, Any] = {}
    for kv in parts[1:]:
        k, _, v = kv.partition("=")
        out[k] = v
    out["patches"] = [p for p in out.get("patches", "").split(",") if p]
    # the native switches (dream-switches.h) as the library read them: NAME=value,...
    out["switches"] = dict(kv.partition("=")[::2] for kv in out.get("switches", "").split(",") if kv)
    return out


@lru_cache(maxsize=1)
def lib() -> ctypes.CDLL:
    """Our libllama as a ctypes library with dream.h's functions declared."""
    mod = llama_cpp()
    L = mod.llama_cpp._lib
    dream_h.declare(L)
    _check_receipt_layout(L, L._name)
    return L


def build_info() -> dict:
    return parse_build_info(lib().dream_build_info().decode())


def _check_receipt_layout(L: ctypes.CDLL, path: str) -> None:
    # A member added on one side only would shift every later field: every
    # receipt would read garbage rather than fail. Checked once, at load.
    if not hasattr(L, "dream_receipt_layout"):
        raise NativeLibraryError(f"{path} has no dream_receipt_layout: it predates this package's dream.h; "
                                 "rebuild with `./dev.sh build`")
    bad = dream_h.receipt_layout_mismatches(L)
    if bad:
        raise NativeLibraryError("dreamstage.native.dream_h.DreamReceiptC does not match struct dream_receipt in "
                                 f"{path}: " + "; ".join(bad))


@lru_cache(maxsize=1)
def context_cache_types() -> tuple[str, ...]:
    """The training cache types the native core accepts (dream_context_cache_types), preferred first."""
    return tuple(lib().dream_context_cache_types().decode().split(","))
