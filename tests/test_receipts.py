"""Receipts as the job stores them: a negative allowance is explained, never shown."""
import ctypes
import os
import subprocess
import sys

from dreamstage import native
from dreamstage.native import dream_h
from dreamstage.training.walk.receipts import RECEIPT_FIELDS, Receipt, mirror_mismatch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def refused(allowance, message="chunk at 0 (32 tokens) needs 40.00 MiB more on CPU"):
    return Receipt("refused", 0, 64, 32, 0, 32, "q8_0", False, False, -1, "forward", 0.0, 0,
                   0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 32, 40.0, allowance, message)


def test_a_budget_below_the_slack_says_so_and_the_allowance_is_zero():
    r = refused(-63.0).with_clear_allowance(1.0, 64.0)
    assert r.refused_allowance_mib == 0.0
    assert r.message.startswith("nothing is left for the job: the memory gate keeps 64 MiB free, and "
                                "min(memory_budget_mib 1 MiB less what the job already holds, "
                                "the device's free memory) "
                                "is 63.00 MiB below that slack")
    assert r.message.endswith("needs 40.00 MiB more on CPU")          # what the gate measured stays
    assert (r.refused_need_mib, r.refused_chunk_tokens, r.status) == (40.0, 32, "refused")


def test_without_a_budget_the_device_is_named():
    r = refused(-10.5, message="").with_clear_allowance(None, 64.0)
    assert r.refused_allowance_mib == 0.0
    assert "the device's free memory is 10.50 MiB below that slack" in r.message


def test_a_positive_allowance_is_left_alone():
    r = refused(12.0)
    assert r.with_clear_allowance(1.0, 64.0) is r


# -- one layout: struct dream_receipt (C), DreamReceiptC (ctypes), Receipt (dataclass) ----
def test_the_ctypes_mirror_matches_the_compiled_struct_member_for_member():
    L = native.lib()                      # loading checks it too; this names what the check compares
    fields = ctypes.POINTER(dream_h.DreamFieldLayoutC)()
    size = ctypes.c_size_t(0)
    n = L.dream_receipt_layout(ctypes.byref(fields), ctypes.byref(size))
    c_side = [(fields[i].name.decode(), fields[i].offset, fields[i].size) for i in range(n)]
    assert [name for name, _, _ in c_side] == list(RECEIPT_FIELDS)
    assert c_side == [(name, getattr(dream_h.DreamReceiptC, name).offset, getattr(dream_h.DreamReceiptC, name).size)
                      for name in RECEIPT_FIELDS]
    assert size.value == ctypes.sizeof(dream_h.DreamReceiptC)
    assert dream_h.receipt_layout_mismatches(L) == []


def _mirror(fields):
    return type("Mirror", (ctypes.Structure,), {"_fields_": fields})


def test_a_mirror_that_disagrees_with_the_c_struct_is_named():
    L, good = native.lib(), list(dream_h.DreamReceiptC._fields_)
    # 8 bytes before `message`: it and every member after it move, and the size changes
    at = [name for name, _ in good].index("message")
    added = dream_h.receipt_layout_mismatches(L, _mirror(good[:at] + [("retries", ctypes.c_int64)] + good[at:]))
    assert "retries is in Mirror but not in struct dream_receipt" in added
    assert any(m.startswith("message: offset") for m in added) and any("sizeof" in m for m in added)
    missing = dream_h.receipt_layout_mismatches(L, _mirror([f for f in good if f[0] != "walk_mib"]))
    assert "walk_mib is in struct dream_receipt but not in Mirror" in missing
    retyped = dream_h.receipt_layout_mismatches(
        L, _mirror([(n, ctypes.c_int32 if n == "step" else t) for n, t in good]))
    assert retyped[0].startswith("sizeof") and any(m.startswith("step: offset 8, size 8 in C; offset 4, size 4")
                                                   for m in retyped)


def test_the_dataclass_names_the_mirrors_fields_in_order():
    assert mirror_mismatch(RECEIPT_FIELDS) is None
    assert RECEIPT_FIELDS == tuple(name for name, _ in dream_h.DreamReceiptC._fields_)
    assert "different order" in mirror_mismatch(RECEIPT_FIELDS[1:] + RECEIPT_FIELDS[:1])
    assert "['retries'] that DreamReceiptC lacks" in mirror_mismatch(RECEIPT_FIELDS + ("retries",))


# A field added to the ctypes mirror only: importing the receipts, or loading
# the library, fails naming it (run in a child: both happen once per process).
DISAGREEING_MIRROR = """
import ctypes, sys
import dreamstage.native.dream_h as dream_h
import dreamstage.native as native
dream_h.DreamReceiptC = type("DreamReceiptC", (ctypes.Structure,),
                             {"_fields_": dream_h.DreamReceiptC._fields_ + [("retries", ctypes.c_int32)]})
try:
    native.lib()
except native.NativeLibraryError as e:
    print("load:", e)
try:
    import dreamstage.training.walk.receipts
except ImportError as e:
    print("import:", e)
"""


def test_a_field_added_on_one_side_only_fails_at_load_and_at_import():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", DISAGREEING_MIRROR], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    load, imp = r.stdout.splitlines()
    assert load.startswith("load: dreamstage.native.dream_h.DreamReceiptC does not match struct dream_receipt")
    assert "retries is in DreamReceiptC but not in struct dream_receipt" in load
    assert imp == "import: dreamstage.training.walk.receipts: Receipt has nothing that DreamReceiptC lacks, " \
                  "and lacks ['retries']"


def test_a_drift_receipt_carries_every_canonical_field_and_folds_as_no_micro_step(tmp_path):
    """A drift measurement is stored beside the micro-steps: a reader that reads
    every receipt's canonical fields (tokens, chunk_tokens, group_reply, ...) reads
    it too, and the job's progress takes its figures without counting a step."""
    import pytest

    from dreamstage.training.drift.guard import drift_receipt
    from dreamstage.training.jobs.request import parse_train_request
    from dreamstage.training.jobs.store import JobStore
    from dreamstage.training.walk.receipts import kind_receipt

    figures = {"drift_kl": 0.25, "anchors_changed": 0.1, "anchors": 20, "anchors_changed_count": 2,
               "anchor_tokens": 400, "max_drift": 0.05, "epoch": 1, "final": True}
    memory = {"graph_mib": 3.0, "context_mib": 1.5, "adapter_mib": 0.5, "optimizer_mib": 1.0, "walk_mib": 0.0}
    d = drift_receipt(figures, step=7, ms=120.0, memory=memory)
    assert set(RECEIPT_FIELDS) <= set(d) and d["kind"] == "drift" and d["status"] == "ok"
    assert (d["step"], d["ms"], d["tokens"], d["chunk_tokens"], d["group_reply"]) == (7, 120.0, 0, 0, -1)
    assert {k: d[k] for k in memory} == memory and d["message"] == "anchors_changed 0.100 (2/20), drift_kl 0.2500"
    with pytest.raises(ValueError, match="'tokens'"):
        kind_receipt("drift", step=0, ms=0.0, tokens=5)
    with pytest.raises(ValueError, match="'bogus'"):
        kind_receipt("bogus", step=0, ms=0.0)
    with JobStore(tmp_path / "state") as s:
        jid = s.submit(parse_train_request({"text": "some text", "window": 64}))["id"]
        s.transition(jid, "starting")
        s.transition(jid, "running")
        s.append_receipt(jid, d)
        job = s.get(jid)
        assert s.receipts(jid) == [d]
    assert job["progress"]["step"] == 0 and job["progress"]["tokens"] == 0
    assert job["progress"]["drift"] == {**figures, "step": 7, "ms": 120.0}
    assert job["progress"]["drift_history"] == [{"epoch": 1, "step": 7, "final": True, "anchors": 20,
                                                 "anchors_changed": 0.1, "drift_kl": 0.25}]


def test_the_early_stop_needs_every_job_window_below_stop_loss():
    """OwnLoss: an epoch converges only when each of the job's own windows is below
    stop_loss; a mean below it with one window above does not; anchor windows
    (indices past the job's) and refused steps do not count."""
    from types import SimpleNamespace as R

    from dreamstage.training.drift.stopping import OwnLoss

    own = OwnLoss(n_job_windows=3, stop_loss=0.1)
    for w, loss in ((0, 0.01), (1, 0.02), (2, 0.25), (5, 3.0)):      # mean of the job's 0.093, one window 0.25
        own.note(w, R(status="ok", loss=loss, tokens=10))
    own.note(2, R(status="refused", loss=0.0, tokens=10))
    assert not own.converged() and own.last == 0.25
    for w, loss in ((0, 0.01), (1, 0.02), (2, 0.05), (2, 0.09), (4, 2.0)):
        own.note(w, R(status="ok", loss=loss, tokens=10))
    assert own.converged() and abs(own.last - 0.07) < 1e-12                # window 2: (0.05 + 0.09) / 2
    assert "every example window's training loss is below stop_loss 0.1 (the highest 0.0700)" in own.stop_note(2)
    assert not OwnLoss(3, None).converged()
