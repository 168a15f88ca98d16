"""Pinned downloads into the user cache, checked against a sha256.

Standard library only: vendor/materialize.py loads this file by path at build
time (inside pip's isolated build environment, before dreamstage is
installed), and the package uses it for the default model on first use.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.request
from collections.abc import Iterable
from pathlib import Path

# Long enough for a slow mirror, short enough that an offline machine fails
# in seconds instead of hanging the first `dreamstage serve`.
TIMEOUT_S = 30
BLOCK = 1 << 20


class FetchError(RuntimeError):
    """A pinned file could not be downloaded or did not match its sha256."""


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def copy_verified(src: Iterable[bytes], dest: Path, sha256: str, what: str) -> Path:
    """Write the blocks of `src` to `dest` if their sha256 is `sha256`.

    The bytes go to a temporary file beside `dest` that is renamed into place
    only after the hash matched, so an interrupted or tampered download never
    leaves a file that a later run would trust.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    h = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for block in src:
                h.update(block)
                out.write(block)
        if h.hexdigest() != sha256:
            raise FetchError(f"sha256 mismatch for {what}: expected {sha256}, got {h.hexdigest()}; "
                             "refusing to use it")
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a cache is shared by the user's tools
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dest


def _blocks(f) -> Iterable[bytes]:
    return iter(lambda: f.read(BLOCK), b"")


def fetch(url: str, dest: Path, sha256: str, *, hint: str = "") -> Path:
    """Download `url` (http, https or file) to `dest`, checked against `sha256`.

    An existing `dest` with the right hash is reused without a download.
    `hint` ends the offline error: how to supply the file without network.
    """
    if dest.is_file() and sha256_of(dest) == sha256:
        return dest
    tail = f"; {hint}" if hint else ""
    try:
        r = urllib.request.urlopen(url, timeout=TIMEOUT_S)
    except OSError as e:  # URLError included: no network, no such host, no such file
        raise FetchError(f"could not download {url}: {getattr(e, 'reason', None) or e} (offline?){tail}") from e
    with r:
        try:
            return copy_verified(_blocks(r), dest, sha256, url)
        except OSError as e:
            raise FetchError(f"download of {url} to {dest.parent} failed: {e}{tail}") from e
