"""The base's anchor records and noise margins kept across restarts (record_file.py):
read back exactly, and never trusted when made for another model or context."""
from types import SimpleNamespace

import numpy as np
import pytest

from dreamstage.serving.resident import ResidentConfig
from dreamstage.training.drift.record_file import FILE_NAME, DriftRecordFile
from dreamstage.training.drift.records import AnchorBase


def fake_resident(tmp_path, **config):
    model = tmp_path / "model.gguf"
    if not model.exists():
        model.write_bytes(b"GGUF" + bytes(60))
    return SimpleNamespace(model_path=model, config=ResidentConfig(**config))


def record(rng, prompt, samples=0):
    n = int(rng.integers(1, 6))
    def ids():
        return rng.integers(0, 1000, (n, 8)).astype(np.int32)

    def logp():
        return np.log(rng.dirichlet(np.ones(8), n)).astype(np.float32)
    return AnchorBase(prompt=prompt, prompt_tokens=tuple(int(t) for t in rng.integers(0, 1000, 7)),
                      continuation=tuple(int(t) for t in rng.integers(0, 1000, n)), forced=(1, 2, 3),
                      answer=tuple(int(t) for t in rng.integers(0, 1000, n)), top_ids=ids(), top_logp=logp(),
                      tail_logp=rng.standard_normal(n), samples=tuple((4, 5, 6)[:n] for _ in range(samples)),
                      sample_top=tuple((ids(), logp()) for _ in range(samples)))


def same(a: AnchorBase, b: AnchorBase) -> bool:
    arrays = ("top_ids", "top_logp", "tail_logp")
    return (all(getattr(a, k) == getattr(b, k) for k in ("prompt", "prompt_tokens", "continuation", "forced",
                                                          "answer", "samples"))
            and all(np.array_equal(getattr(a, k), getattr(b, k)) and getattr(a, k).dtype == getattr(b, k).dtype
                    for k in arrays)
            and all(np.array_equal(x, y) for s, t in zip(a.sample_top, b.sample_top, strict=True)
                    for x, y in zip(s, t, strict=True)))


def test_records_and_margins_are_read_back_exactly(tmp_path):
    rng = np.random.default_rng(0)
    records = {p: record(rng, p, samples=i % 2 * 2) for i, p in enumerate(["What is 2+2?", "Name a colour.", "é?"])}
    margins = {(("What is 2+2?", "é?"), 8, 16.0, "attn_q,attn_v", 0): (0.742, (0.1, 0.742, 0.8))}
    # the guard's cache also holds the base's neighbours of a question: not records, not kept
    DriftRecordFile(tmp_path, fake_resident(tmp_path)).save({**records, ("Why?", 4): ["Why not?"]}, margins)
    got, got_margins = DriftRecordFile(tmp_path, fake_resident(tmp_path)).load()
    assert list(got) == list(records) and all(same(records[p], got[p]) for p in records)
    assert got_margins == margins


def test_a_file_for_another_model_or_context_or_an_unreadable_one_is_ignored(tmp_path):
    rng = np.random.default_rng(1)
    records = {"Say hi.": record(rng, "Say hi.")}
    DriftRecordFile(tmp_path, fake_resident(tmp_path)).save(records, {})
    assert DriftRecordFile(tmp_path, fake_resident(tmp_path, kv_type="q8_0")).load() == ({}, {})
    assert list(DriftRecordFile(tmp_path, fake_resident(tmp_path)).load()[0]) == ["Say hi."]
    (tmp_path / "model.gguf").write_bytes(b"GGUF" + bytes(61))        # the model file changed
    assert DriftRecordFile(tmp_path, fake_resident(tmp_path)).load() == ({}, {})
    (tmp_path / FILE_NAME).write_bytes(b"not a zip file")
    assert DriftRecordFile(tmp_path, fake_resident(tmp_path)).load() == ({}, {})


def test_a_save_writes_only_what_grew_and_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    rng = np.random.default_rng(2)
    f = DriftRecordFile(tmp_path, fake_resident(tmp_path))
    f.save({}, {})
    assert not (tmp_path / FILE_NAME).exists()                         # nothing to keep
    records = {"One?": record(rng, "One?")}
    f.save(records, {})
    before = (tmp_path / FILE_NAME).stat().st_mtime_ns
    f.save(dict(records), {})                                          # unchanged: not written again
    assert (tmp_path / FILE_NAME).stat().st_mtime_ns == before
    records["Two?"] = record(rng, "Two?")

    def full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(np, "savez", full)
    f.save(records, {})                                                # logs, raises nothing
    monkeypatch.undo()
    assert list(DriftRecordFile(tmp_path, fake_resident(tmp_path)).load()[0]) == ["One?"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".drift")] == []
    f.save(records, {})
    assert list(DriftRecordFile(tmp_path, fake_resident(tmp_path)).load()[0]) == ["One?", "Two?"]


@pytest.mark.parametrize("bad", ["meta", "records"])
def test_a_file_missing_its_parts_is_ignored(tmp_path, bad):
    rng = np.random.default_rng(3)
    DriftRecordFile(tmp_path, fake_resident(tmp_path)).save({"Q?": record(rng, "Q?")}, {})
    with np.load(tmp_path / FILE_NAME) as z:
        parts = {k: z[k] for k in z.files if not (bad == "meta" and k == "meta")
                 and not (bad == "records" and k.startswith("0.top_logp"))}
    np.savez(tmp_path / FILE_NAME, **parts)
    assert DriftRecordFile(tmp_path, fake_resident(tmp_path)).load() == ({}, {})


def test_a_background_save_writes_what_the_cache_held_when_it_was_asked(tmp_path):
    rng = np.random.default_rng(4)
    cache = {"A?": record(rng, "A?")}
    f = DriftRecordFile(tmp_path, fake_resident(tmp_path))
    f.save_in_background(cache, {})
    cache["B?"] = record(rng, "B?")                                    # after the call: not in this save
    f.wait()
    got, _ = DriftRecordFile(tmp_path, fake_resident(tmp_path)).load()
    assert list(got) == ["A?"] and same(got["A?"], cache["A?"])
    f.save_in_background(cache, {})
    f.wait()
    assert list(DriftRecordFile(tmp_path, fake_resident(tmp_path)).load()[0]) == ["A?", "B?"]
