import ctypes
import json
from pathlib import Path

import pytest

from dreamstage import native
from dreamstage.native import ggml_registry

PIN = json.loads((Path(__file__).resolve().parents[1] / "vendor" / "pin.json").read_text())


def test_loaded_libllama_is_ours_and_pinned():
    lc = native.llama_cpp()
    loaded = Path(lc.llama_cpp._lib._name).resolve()
    assert loaded.parent == native.lib_dir()
    info = native.build_info()
    assert info["llama-cpp-python"] == PIN["version"]
    assert info["upstream"] == PIN["upstream_commit"]
    patches = sorted(p.name for p in (Path(__file__).resolve().parents[1] / "vendor" / "patches").glob("*.patch"))
    assert info["patches"] == patches


def test_only_one_libllama_in_process():
    native.lib()
    maps = Path("/proc/self/maps").read_text().splitlines()
    libs = {line.split()[-1] for line in maps if "libllama" in line}
    assert len(libs) == 1, libs
    assert Path(next(iter(libs))).parent == native.lib_dir()


def test_foreign_library_identity_is_refused():
    with pytest.raises(native.NativeLibraryError, match="unexpected build identity"):
        native.parse_build_info("llama.cpp;b1234")


def test_library_without_identity_is_refused(tmp_path):
    libc = ctypes.CDLL("libc.so.6")
    with pytest.raises(native.NativeLibraryError, match="not dreamstage's libllama"):
        native._check_identity(libc, tmp_path / "libllama.so")


def test_backends_and_devices_report_cpu_memory():
    assert "CPU" in ggml_registry.backends()
    cpu = [d for d in ggml_registry.devices() if d["name"] == "CPU"]
    assert cpu and 0 < cpu[0]["free"] <= cpu[0]["total"]


@pytest.mark.parametrize("cuda_build", [True, False])
def test_a_cuda_build_gets_the_shared_libstdcxx_in_the_global_scope_first(tmp_path, cuda_build):
    """A library directory with libggml-cuda.so (whose static libstdc++ crashed the
    model load: docs/architecture/gpu.md, "One libstdc++") makes the loader open the
    shared libstdc++.so.6 globally first: a libstdc++ symbol then resolves from the
    process's global scope. A CPU build's directory leaves the scope as it was. In a
    fresh interpreter with numpy imported (which loads libstdc++ only locally)."""
    import subprocess
    import sys
    (tmp_path / "libllama.so").write_bytes(b"")
    if cuda_build:
        (tmp_path / "libggml-cuda.so").write_bytes(b"")
    probe = (
        "import ctypes, sys\n"
        "from pathlib import Path\n"
        "import numpy\n"
        "from dreamstage import native\n"
        "def global_sym():\n"
        "    try:\n"
        "        ctypes.CDLL(None)._ZNSt6locale7classicEv\n"
        "        return True\n"
        "    except AttributeError:\n"
        "        return False\n"
        "before = global_sym()\n"
        "native._shared_libstdcxx_first(Path(sys.argv[1]))\n"
        "print(before, global_sym())\n")
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    before, after = out.stdout.split()
    assert before == "False"
    assert after == str(cuda_build)
