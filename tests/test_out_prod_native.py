"""OUT_PROD with a quantized src0 (tests/native/out_prod_check.cpp).

On a machine with a CUDA build and a GPU this runs the CUDA op against the CPU
backend for every handled type; without one it checks the CPU backend's quantized
OUT_PROD against the F32 reference, so the reference itself stays tested in CI.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "native"))
import out_prod_build


@pytest.fixture(scope="module")
def checker(tmp_path_factory):
    if out_prod_build.compiler() is None:
        pytest.skip("no C++ compiler")
    return out_prod_build.build_out_prod_check(tmp_path_factory.mktemp("native") / "out_prod_check")


def test_out_prod_quantized_matches_f32_reference(checker, tmp_path):
    report = tmp_path / "out_prod.json"
    r = subprocess.run([str(checker), "--quick", "--json", str(report)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    result = json.loads(report.read_text())
    assert result["failures"] == 0
    # every handled type was exercised: 14 types x 4 shapes
    assert len(result["cases"]) == 56
    checked = [c for c in result["cases"] if "cpu_q_rel_l2" in c]
    # the CPU has no BF16 OUT_PROD and no quantized broadcast: 13 types x 3 shapes
    assert len(checked) == 39
    if result["gpu"]:
        assert all("gpu_vs_cpu_rel_l2" in c for c in result["cases"])
