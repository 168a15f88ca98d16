import ctypes
import json
from pathlib import Path

import pytest

from dreamstage import native

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
    assert "CPU" in native.backends()
    cpu = [d for d in native.devices() if d["name"] == "CPU"]
    assert cpu and 0 < cpu[0]["free"] <= cpu[0]["total"]
