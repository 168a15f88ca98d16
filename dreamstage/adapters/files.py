"""Adapter files: the standard GGUF LoRA format that stock llama.cpp loads with --lora.

Layout (as llama-adapter.cpp's loader expects): general.type = "adapter",
general.architecture = the base model's, adapter.type = "lora",
adapter.lora.alpha (f32); per adapted weight "blk.N.<target>.weight" two F32
tensors "<weight>.lora_a" with numpy shape (rank, n_in) (GGUF ne [n_in, rank])
and "<weight>.lora_b" with numpy shape (n_out, rank) (ne [rank, n_out]).
Files are written atomically: a temporary file in the same directory,
fsync, rename, fsync of the directory.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight\.lora_([ab])$")
# An adapter's matrices: {(layer, target): (A (rank, n_in), B (n_out, rank))}.
Factors = dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]


@contextmanager
def atomic_file(path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; when the block succeeds, fsync it,
    rename it over `path` and fsync the directory. On any failure the
    temporary file is removed and `path` is left as it was."""
    path = Path(path)
    private_dirs(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def private_dirs(path: Path) -> None:
    """Make `path` and its missing parents, each owner-only (0700); existing ones are left as they are."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        d.mkdir(mode=0o700, exist_ok=True)


def file_sha256(path) -> str:
    """The hex sha256 of a file's bytes (an adapter as saved, to check on reload)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save_lora(path, factors: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]], *, alpha: float,
              model_arch: str) -> Path:
    """Write {(layer, target): (A, B)} as a GGUF LoRA adapter at `path`, atomically."""
    import gguf

    path = Path(path)
    if not factors:
        raise ValueError("an adapter needs at least one (A, B) pair")
    with atomic_file(path) as tmp:
        w = gguf.GGUFWriter(str(tmp), model_arch)
        # A failed write (a full disk) must still close the file: an open
        # handle on the deleted temp file would keep its space taken.
        with contextlib.closing(w):
            _write_lora(w, factors, alpha)
    return path


def _write_lora(w, factors, alpha: float) -> None:
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(alpha))
    for (layer, target), (a, b) in sorted(factors.items()):
        a = np.ascontiguousarray(a, dtype=np.float32)
        b = np.ascontiguousarray(b, dtype=np.float32)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"blk.{layer}.{target}: A {a.shape} and B {b.shape} are not (rank, n_in), (n_out, rank)")
        w.add_tensor(f"blk.{layer}.{target}.weight.lora_a", a)
        w.add_tensor(f"blk.{layer}.{target}.weight.lora_b", b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()


def load_lora(path) -> tuple[dict[tuple[int, str], tuple[np.ndarray, np.ndarray]], float]:
    """Read a GGUF LoRA adapter: ({(layer, target): (A, B)}, alpha)."""
    import gguf

    path = Path(path)
    r = gguf.GGUFReader(str(path))

    def field_value(key):
        f = r.get_field(key)
        return None if f is None else f.contents()

    if field_value("general.type") != "adapter" or field_value("adapter.type") != "lora":
        raise ValueError(f"{path} is not a GGUF LoRA adapter (general.type={field_value('general.type')!r}, "
                         f"adapter.type={field_value('adapter.type')!r})")
    alpha = field_value("adapter.lora.alpha")
    if alpha is None:
        raise ValueError(f"{path} has no adapter.lora.alpha")
    parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for t in r.tensors:
        m = _NAME.match(t.name)
        if not m:
            raise ValueError(f"{path}: tensor {t.name!r} is not blk.N.<target>.weight.lora_a|b")
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ValueError(f"{path}: tensor {t.name!r} is {t.tensor_type.name}, expected F32")
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        matrix = np.array(t.data, dtype=np.float32).reshape(shape)
        parts.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = matrix
    out = {}
    for key, ab in parts.items():
        if set(ab) != {"a", "b"}:
            raise ValueError(f"{path}: blk.{key[0]}.{key[1]} lacks lora_{'b' if 'a' in ab else 'a'}")
        out[key] = (ab["a"], ab["b"])
    return out, float(alpha)


def lora_rank(path) -> int:
    """The largest rank among a GGUF LoRA's tensors (a `lora_a` is [n_in, rank]);
    0 for a file with none. Reads the header only."""
    import gguf

    r = gguf.GGUFReader(str(path))
    return max((int(t.shape[1]) for t in r.tensors if t.name.endswith(".lora_a") and len(t.shape) > 1),
               default=0)


def lora_rank_of(path: str) -> int:
    """`lora_rank`, or 0 when the header cannot be read (llama.cpp's loader then names the fault)."""
    try:
        return lora_rank(path)
    except (OSError, ValueError):
        return 0
