"""The base's anchor records and noise margins, kept in the state directory so a
restarted server does not record them again (minutes of decoding on a CPU).

One file, `state_dir/drift-records.npz`, written atomically. It belongs to the
model file and the context settings that decide the base's logits; a file made
for anything else (or unreadable) is ignored and made again, never trusted.
Loaded without pickle: arrays, plus one JSON string for the rest.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from dreamstage.training.drift.decoding import TOP_K
from dreamstage.training.drift.records import ANCHOR_TOKENS, SAMPLE_SEED, AnchorBase

log = logging.getLogger("dreamstage.drift")

FILE_NAME = "drift-records.npz"
FORMAT = 1


def identity(resident) -> dict[str, Any]:
    """What the base's records depend on: the model file and how its logits are made."""
    path = Path(resident.model_path).resolve()
    st = path.stat()
    cfg = resident.config
    return {"format": FORMAT, "model": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "kv_type": cfg.kv_type, "flash_attn": cfg.flash_attn, "n_gpu_layers": cfg.n_gpu_layers,
            "anchor_tokens": ANCHOR_TOKENS, "top_k": TOP_K, "sample_seed": SAMPLE_SEED}


def _tokens(a) -> np.ndarray:
    return np.asarray(a, dtype=np.int64)


def _record_arrays(i: int, b: AnchorBase) -> dict[str, np.ndarray]:
    out = {f"{i}.prompt_tokens": _tokens(b.prompt_tokens), f"{i}.continuation": _tokens(b.continuation),
           f"{i}.forced": _tokens(b.forced), f"{i}.answer": _tokens(b.answer), f"{i}.top_ids": b.top_ids,
           f"{i}.top_logp": b.top_logp, f"{i}.tail_logp": b.tail_logp}
    for j, (s, (ids, logp)) in enumerate(zip(b.samples, b.sample_top, strict=True)):
        out.update({f"{i}.sample{j}": _tokens(s), f"{i}.sample{j}.ids": ids, f"{i}.sample{j}.logp": logp})
    return out


def _record(i: int, prompt: str, n_samples: int, z) -> AnchorBase:
    def ints(k: str) -> tuple[int, ...]:
        return tuple(int(t) for t in z[f"{i}.{k}"])
    return AnchorBase(prompt=prompt, prompt_tokens=ints("prompt_tokens"), continuation=ints("continuation"),
                      forced=ints("forced"), answer=ints("answer"), top_ids=z[f"{i}.top_ids"],
                      top_logp=z[f"{i}.top_logp"], tail_logp=z[f"{i}.tail_logp"],
                      samples=tuple(ints(f"sample{j}") for j in range(n_samples)),
                      sample_top=tuple((z[f"{i}.sample{j}.ids"], z[f"{i}.sample{j}.logp"])
                                       for j in range(n_samples)))


class DriftRecordFile:
    """Reads and writes one state directory's records for one resident model."""

    def __init__(self, state_dir: str | Path, resident):
        self.path = Path(state_dir) / FILE_NAME
        self.identity = identity(resident)
        self._saved: tuple[int, int] = (0, 0)          # (records, margins) in the file
        self._lock = threading.Lock()                   # one write at a time
        self._writer: threading.Thread | None = None

    def load(self) -> tuple[dict[str, AnchorBase], dict[tuple, tuple[float, tuple[float, ...]]]]:
        """The records and margins in the file; both empty when it is absent, unreadable
        or made for another model or context."""
        if not self.path.exists():
            return {}, {}
        try:
            with np.load(self.path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                if meta.get("identity") != self.identity:
                    log.info("%s was made for another model or context; the anchors are recorded again", self.path)
                    return {}, {}
                records = {p: _record(i, p, n, z) for i, (p, n) in enumerate(meta["records"])}
            margins = {(tuple(m["prompts"]), *m["shape"]): (float(m["margin"]), tuple(m["draws"]))
                       for m in meta["margins"]}
        except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as e:
            log.warning("%s is unreadable (%s); the anchors are recorded again", self.path, e)
            return {}, {}
        self._saved = (len(records), len(margins))
        log.info("drift: %d anchor records and %d noise margins loaded from %s", *self._saved, self.path)
        return records, margins

    def save(self, cache: dict, margins: dict[tuple, tuple[float, Any]]) -> None:
        """Writes the anchor records in `cache` (the guard's cache also holds other
        entries, such as neighbours by (question, n): those are not kept) and the
        margins, when either grew since the last load or save; a failed write only logs."""
        records = {p: b for p, b in cache.items() if isinstance(p, str) and isinstance(b, AnchorBase)}
        with self._lock:
            if (len(records), len(margins)) != self._saved:
                self._write(records, dict(margins))

    def save_in_background(self, cache: dict, margins: dict[tuple, tuple[float, Any]]) -> None:
        """save() on a thread of its own (about 0.1 s of writing that the engine
        thread, which calls this, should not wait for); the records are immutable,
        so shallow copies taken here are what is written."""
        self.wait()
        self._writer = threading.Thread(target=self.save, args=(dict(cache), dict(margins)),
                                        name="dreamstage-drift-records")
        self._writer.start()

    def wait(self) -> None:
        """Until the last background save has ended."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def _write(self, records: dict[str, AnchorBase], margins: dict[tuple, tuple[float, Any]]) -> None:
        arrays: dict[str, np.ndarray] = {}
        listed = []
        for i, (prompt, b) in enumerate(records.items()):
            arrays.update(_record_arrays(i, b))
            listed.append((prompt, len(b.samples)))
        meta = {"identity": self.identity, "records": listed,
                "margins": [{"prompts": list(k[0]), "shape": list(k[1:]), "margin": float(m), "draws": list(d)}
                            for k, (m, d) in margins.items()]}
        arrays["meta"] = np.array(json.dumps(meta))
        try:
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".drift-records-", suffix=".npz")
            try:
                with os.fdopen(fd, "wb") as f:
                    np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy's stub types allow_pickle here
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as e:
            log.warning("drift records not saved to %s: %s", self.path, e)
            return
        self._saved = (len(records), len(margins))
