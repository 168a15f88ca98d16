"""Receipts as the job stores them: a negative allowance is explained, never shown."""
from dreamstage.training.receipts import Receipt


def refused(allowance, message="chunk at 0 (32 tokens) needs 40.00 MiB more on CPU"):
    return Receipt("refused", 0, 64, 32, 0, 32, "q8_0", False, False, -1, "forward", 0.0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                   0, 32, 40.0, allowance, message)


def test_a_budget_below_the_slack_says_so_and_the_allowance_is_zero():
    r = refused(-63.0).with_clear_allowance(1.0, 64.0)
    assert r.refused_allowance_mib == 0.0
    assert r.message.startswith("nothing is left for the job: the memory gate keeps 64 MiB free, and "
                                "min(memory_budget_mib 1 MiB less what the job already holds, the device's free memory) "
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
