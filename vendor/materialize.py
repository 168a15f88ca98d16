#!/usr/bin/env python3
"""Materialize the pinned, patched llama.cpp tree under vendor/llama.cpp.

The upstream source is never committed. This script:
  1. finds the pinned llama-cpp-python sdist (DREAMSTAGE_LLAMA_SDIST, the local
     cache, or `pip download` by exact name and version);
  2. checks its sha256 against vendor/pin.json and refuses a mismatch by name;
  3. extracts the sdist's vendor/llama.cpp into a fresh directory, makes it a
     local git repository (one commit "upstream"), applies vendor/patches/*.patch
     in order, one commit each, so `git format-patch` exports edits back;
  4. writes a stamp (pin + patch hashes). A re-run with the same stamp is a no-op.

DREAMSTAGE_LLAMA_TREE may point at an already-materialized tree; it is used as
is when its stamp matches the pin and the patch series.

Usage: materialize.py [--print-tree] [--check-only] [--dest DIR]
Exit status is nonzero, with a message naming the file, on any failure.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VENDOR = Path(__file__).resolve().parent
PIN_FILE = VENDOR / "pin.json"
PATCH_DIR = VENDOR / "patches"
STAMP_NAME = ".dreamstage-stamp.json"
# Parts of upstream the build never reads; skipping them keeps extraction fast.
SKIP_TOP = {".git", "models", "docs", "media", "benches", "tests", ".github", "gguf-py", "conversion"}


class MaterializeError(RuntimeError):
    pass


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_pin() -> dict:
    return json.loads(PIN_FILE.read_text())


def patch_series() -> list[Path]:
    return sorted(PATCH_DIR.glob("*.patch"))


def expected_stamp(pin: dict) -> dict:
    return {
        "package": pin["package"],
        "version": pin["version"],
        "sha256": pin["sha256"],
        "upstream_commit": pin["upstream_commit"],
        "patches": [{"name": p.name, "sha256": sha256_of(p)} for p in patch_series()],
    }


def read_stamp(tree: Path) -> dict | None:
    try:
        return json.loads((tree / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None


def cache_dir() -> Path:
    base = os.environ.get("DREAMSTAGE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dreamstage")
    return Path(base)


def _pip_command() -> list[str]:
    # Inside an isolated build environment pip may be missing from sys.executable.
    try:
        import pip  # noqa: F401
        return [sys.executable, "-m", "pip"]
    except ImportError:
        for name in ("pip3", "pip"):
            exe = shutil.which(name)
            if exe:
                return [exe]
    raise MaterializeError("pip is not available to fetch the pinned sdist; "
                           "set DREAMSTAGE_LLAMA_SDIST to a downloaded copy")


def find_sdist(pin: dict) -> Path:
    env = os.environ.get("DREAMSTAGE_LLAMA_SDIST")
    if env:
        p = Path(env)
        if not p.is_file():
            raise MaterializeError(f"DREAMSTAGE_LLAMA_SDIST={env}: no such file")
        return p
    dest = cache_dir() / "sdist"
    cached = dest / pin["sdist"]
    if cached.is_file() and sha256_of(cached) == pin["sha256"]:
        return cached
    dest.mkdir(parents=True, exist_ok=True)
    spec = f"{pin['package']}=={pin['version']}"
    print(f"[materialize] fetching {spec} sdist with pip", file=sys.stderr)
    # --no-build-isolation: preparing the sdist's metadata needs only
    # scikit-build-core, which the build already has; isolation would fetch it again.
    cmd = _pip_command() + ["download", "--no-deps", "--no-binary", pin["package"],
                            "--no-build-isolation", "-d", str(dest), spec]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or not cached.is_file():
        raise MaterializeError(f"pip could not fetch {spec}:\n{r.stdout}\n{r.stderr}")
    return cached


def verify_sdist(path: Path, pin: dict) -> None:
    got = sha256_of(path)
    if got != pin["sha256"]:
        raise MaterializeError(
            f"sha256 mismatch for {path}: expected {pin['sha256']} (vendor/pin.json), got {got}; "
            "refusing to build from it")


def _git(tree: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, GIT_AUTHOR_NAME="dreamstage", GIT_AUTHOR_EMAIL="build@dreamstage",
               GIT_COMMITTER_NAME="dreamstage", GIT_COMMITTER_EMAIL="build@dreamstage",
               GIT_AUTHOR_DATE="2026-10-01T00:00:00Z", GIT_COMMITTER_DATE="2026-10-01T00:00:00Z")
    return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True,
                          input=stdin, env=env)


def extract(sdist: Path, into: Path) -> None:
    prefix = sdist.name[: -len(".tar.gz")] + "/vendor/llama.cpp/"
    with tarfile.open(sdist, "r:gz") as tf:
        members = []
        for m in tf.getmembers():
            if not m.name.startswith(prefix):
                continue
            rel = m.name[len(prefix):]
            if not rel or rel.split("/", 1)[0] in SKIP_TOP:
                continue
            if not (m.isfile() or m.isdir()):
                continue  # no links or devices from an archive
            m.name = rel
            members.append(m)
        if not members:
            raise MaterializeError(f"{sdist}: has no vendor/llama.cpp tree")
        tf.extractall(into, members=members, filter="data")


def apply_patches(tree: Path) -> None:
    for patch in patch_series():
        r = _git(tree, "apply", "--index", "--whitespace=nowarn", str(patch))
        if r.returncode != 0:
            raise MaterializeError(f"patch {patch} failed to apply to the pinned tree:\n{r.stderr}")
        r = _git(tree, "commit", "-q", "--no-verify", "-m", patch.stem)
        if r.returncode != 0:
            raise MaterializeError(f"patch {patch}: commit failed:\n{r.stderr}")


def materialize(dest: Path, pin: dict) -> Path:
    want = expected_stamp(pin)
    if read_stamp(dest) == want:
        return dest
    sdist = find_sdist(pin)
    verify_sdist(sdist, pin)
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".llama.cpp-", dir=dest.parent))
    try:
        extract(sdist, work)
        for args in (("init", "-q"), ("add", "-A"), ("commit", "-q", "--no-verify", "-m", "upstream")):
            r = _git(work, *args)
            if r.returncode != 0:
                raise MaterializeError(f"git {' '.join(args)} in {work} failed:\n{r.stderr}")
        _git(work, "tag", "upstream")
        apply_patches(work)
        (work / STAMP_NAME).write_text(json.dumps(want, indent=2) + "\n")
        # git must not see the stamp as a change
        (work / ".git" / "info" / "exclude").write_text(STAMP_NAME + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(work, dest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return dest


def resolve_tree(dest: Path | None = None) -> Path:
    pin = load_pin()
    env = os.environ.get("DREAMSTAGE_LLAMA_TREE")
    if env:
        tree = Path(env).resolve()
        stamp = read_stamp(tree)
        if stamp != expected_stamp(pin):
            raise MaterializeError(
                f"DREAMSTAGE_LLAMA_TREE={tree}: its {STAMP_NAME} does not match vendor/pin.json "
                "and vendor/patches; rematerialize it")
        return tree
    return materialize(dest or VENDOR / "llama.cpp", pin)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, default=None, help="tree location (default vendor/llama.cpp)")
    ap.add_argument("--print-tree", action="store_true", help="print the tree path on stdout")
    args = ap.parse_args(argv)
    try:
        tree = resolve_tree(args.dest)
    except MaterializeError as e:
        print(f"[materialize] error: {e}", file=sys.stderr)
        return 2
    if args.print_tree:
        print(tree)
    return 0


if __name__ == "__main__":
    sys.exit(main())
