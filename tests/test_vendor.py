"""The pinned tree: the patch series applies cleanly, and a tampered sdist is refused."""
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MATERIALIZE = ROOT / "vendor" / "materialize.py"


def _run(dest, **env):
    e = dict(os.environ)
    e.pop("DREAMSTAGE_LLAMA_TREE", None)
    e.update(env)
    return subprocess.run([sys.executable, str(MATERIALIZE), "--dest", str(dest), "--print-tree"],
                          capture_output=True, text=True, env=e, timeout=600)


def test_patch_series_applies_cleanly_to_pinned_tree(tmp_path):
    r = _run(tmp_path / "llama.cpp")
    assert r.returncode == 0, r.stderr
    tree = Path(r.stdout.strip())
    stamp = json.loads((tree / ".dreamstage-stamp.json").read_text())
    patches = sorted(p.name for p in (ROOT / "vendor" / "patches").glob("*.patch"))
    assert [p["name"] for p in stamp["patches"]] == patches
    log = subprocess.run(["git", "-C", str(tree), "log", "--format=%s"], capture_output=True, text=True).stdout.split()
    assert log[-1] == "upstream"
    assert len(log) == 1 + len(patches)
    assert subprocess.run(["git", "-C", str(tree), "status", "--porcelain"],
                          capture_output=True, text=True).stdout == ""
    # the pure-Python bindings from the same sdist, beside the tree and outside its git
    bindings = tree / stamp["bindings"]
    assert (bindings / "llama_cpp" / "llama_cpp.py").is_file() and (bindings / "LICENSE.md").is_file()
    assert not (bindings / "llama_cpp" / "server").exists()
    # a second run is a no-op: the tree is not rebuilt
    mtime = (tree / ".dreamstage-stamp.json").stat().st_mtime_ns
    r2 = _run(tmp_path / "llama.cpp")
    assert r2.returncode == 0
    assert (tree / ".dreamstage-stamp.json").stat().st_mtime_ns == mtime


def test_tampered_sdist_is_refused_by_name(tmp_path):
    fake = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    fake.write_bytes(gzip.compress(b"not the pinned sdist"))
    dest = tmp_path / "llama.cpp"
    r = _run(dest, DREAMSTAGE_LLAMA_SDIST=str(fake))
    assert r.returncode != 0
    assert "sha256 mismatch" in r.stderr and str(fake) in r.stderr
    assert not dest.exists()


def test_foreign_tree_is_refused(tmp_path):
    (tmp_path / "tree").mkdir()
    r = _run(tmp_path / "unused", DREAMSTAGE_LLAMA_TREE=str(tmp_path / "tree"))
    assert r.returncode != 0 and "DREAMSTAGE_LLAMA_TREE" in r.stderr


@pytest.mark.parametrize("name", ["vendor/llama.cpp/src/llama.cpp", "vendor/llama.cpp/ggml/include/ggml.h"])
def test_upstream_sources_are_not_tracked(name):
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", name], capture_output=True, text=True).stdout
    assert out == ""
