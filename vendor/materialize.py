#!/usr/bin/env python3
"""Materialize the pinned, patched llama.cpp tree under vendor/llama.cpp.

The upstream source is never committed. This script:
  1. finds the pinned llama-cpp-python sdist (DREAMSTAGE_LLAMA_SDIST, the local
     cache, or a download from pin.json's url);
  2. checks its sha256 against vendor/pin.json and refuses a mismatch by name;
  3. extracts the sdist's vendor/llama.cpp into a fresh directory, makes it a
     local git repository (one commit "upstream"), applies vendor/patches/*.patch
     in order, one commit each, so `git format-patch` exports edits back;
  4. extracts the sdist's pure-Python `llama_cpp` package (the bindings, without
     its server) and its license into python-bindings/ inside the tree, outside
     git; the build installs them beside our libraries;
  5. writes a stamp (pin + patch hashes). A re-run with the same stamp is a no-op.

DREAMSTAGE_LLAMA_TREE may point at an already-materialized tree; it is used as
is when its stamp matches the pin and the patch series.

Usage: materialize.py [--print-tree] [--check-only] [--dest DIR]
Exit status is nonzero, with a message naming the file, on any failure.
"""
from __future__ import annotations

import argparse
import importlib.util
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
BINDINGS_DIR = "python-bindings"
# Parts of upstream the build never reads; skipping them keeps extraction fast.
SKIP_TOP = frozenset({".git", "models", "docs", "media", "benches", "tests", ".github", "gguf-py", "conversion"})
# llama_cpp.server needs extras (sse-starlette, starlette-context) we do not
# install; dreamstage has its own server.
SKIP_BINDINGS = frozenset({"server", "__pycache__"})


def _load(name: str):
    # dreamstage/<name>.py by path: this script runs at build time, before the
    # package (and its dependencies) are importable.
    spec = importlib.util.spec_from_file_location(
        f"_dreamstage_{name}", VENDOR.parent / "dreamstage" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod      # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


fetch = _load("fetch")
environment = _load("environment")
sha256_of = fetch.sha256_of
cache_dir = environment.cache_dir


class MaterializeError(RuntimeError):
    pass


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
        "bindings": BINDINGS_DIR,
        "patches": [{"name": p.name, "sha256": sha256_of(p)} for p in patch_series()],
    }


def read_stamp(tree: Path) -> dict | None:
    try:
        return json.loads((tree / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None


def find_sdist(pin: dict) -> Path:
    env = environment.get("DREAMSTAGE_LLAMA_SDIST")
    if env:
        p = Path(env)
        if not p.is_file():
            raise MaterializeError(f"DREAMSTAGE_LLAMA_SDIST={env}: no such file")
        return p
    cached = cache_dir() / "sdist" / pin["sdist"]
    if not cached.is_file():
        print(f"[materialize] fetching {pin['url']}", file=sys.stderr)
    try:
        return fetch.fetch(pin["url"], cached, pin["sha256"],
                           hint=f"set DREAMSTAGE_LLAMA_SDIST to a downloaded copy of {pin['sdist']}")
    except fetch.FetchError as e:
        raise MaterializeError(str(e)) from e


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
    try:
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True,
                              input=stdin, env=env)
    except FileNotFoundError:
        raise MaterializeError("git is needed to apply vendor/patches to the pinned tree; install git") from None


def _members(tf: tarfile.TarFile, prefix: str, dest: str = "", skip_top: frozenset[str] = frozenset(),
             skip_any: frozenset[str] = frozenset()) -> list[tarfile.TarInfo]:
    """The archive's regular files and directories under `prefix`, renamed to `dest`/rest,
    without those whose first path part is in `skip_top` or any part in `skip_any`."""
    out = []
    for m in tf.getmembers():
        if not m.name.startswith(prefix):
            continue
        rel = m.name[len(prefix):]
        parts = rel.split("/")
        if not rel or parts[0] in skip_top or skip_any.intersection(parts):
            continue
        if not (m.isfile() or m.isdir()):
            continue  # no links or devices from an archive
        m.name = f"{dest}/{rel}" if dest else rel
        out.append(m)
    return out


def extract(sdist: Path, into: Path) -> None:
    top = sdist.name[: -len(".tar.gz")] + "/"
    with tarfile.open(sdist, "r:gz") as tf:
        tree = _members(tf, top + "vendor/llama.cpp/", skip_top=SKIP_TOP)
        if not tree:
            raise MaterializeError(f"{sdist}: has no vendor/llama.cpp tree")
        bindings = _members(tf, top + "llama_cpp/", f"{BINDINGS_DIR}/llama_cpp", skip_any=SKIP_BINDINGS)
        license_ = [m for m in tf.getmembers() if m.name == top + "LICENSE.md"]
        if not bindings or not license_:
            raise MaterializeError(f"{sdist}: has no llama_cpp package or LICENSE.md")
        license_[0].name = f"{BINDINGS_DIR}/LICENSE.md"
        tf.extractall(into, members=tree + bindings + license_, filter="data")


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
            if args[0] == "init":
                # the bindings and the stamp are ours, not the upstream tree's
                (work / ".git" / "info").mkdir(exist_ok=True)
                (work / ".git" / "info" / "exclude").write_text(f"{STAMP_NAME}\n/{BINDINGS_DIR}/\n")
        _git(work, "tag", "upstream")
        apply_patches(work)
        (work / STAMP_NAME).write_text(json.dumps(want, indent=2) + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(work, dest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return dest


def resolve_tree(dest: Path | None = None) -> Path:
    pin = load_pin()
    env = environment.get("DREAMSTAGE_LLAMA_TREE")
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
