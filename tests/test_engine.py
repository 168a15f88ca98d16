"""The engine without HTTP: batching, sampling, stop strings, cancellation, the dream hook."""
import json
import queue
import threading

import pytest

from dreamstage.serving.engine import (
    Admitted,
    Delta,
    Engine,
    Failed,
    Finished,
    GenerationRequest,
    QueueFull,
    TextStream,
)
from dreamstage.serving.resident import ResidentConfig, ResidentModel
from dreamstage.serving.sampling import SamplingParams, json_schema_grammar

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
GREEDY = SamplingParams(temperature=0.0)


class RecordingHook:
    def __init__(self):
        self.calls = []          # (idle, decode_batches at call time)
        self.batch_tokens = []   # (tokens, decode tokens) of the batch before each busy call
        self.idle_seen = threading.Event()

    def after_batch(self, engine, idle):
        self.calls.append((idle, engine.stats.decode_batches))
        if not idle:
            self.batch_tokens.append((engine.last_batch_tokens, engine.last_batch_decode_tokens))
        if idle:
            self.idle_seen.set()


@pytest.fixture(scope="module")
def engine():
    model = ResidentModel(ResidentConfig(n_ctx=1024, n_seq=4, n_threads=1, kv_unified=False))
    hook = RecordingHook()
    eng = Engine(model, max_queue=2, hook=hook).start()
    eng.test_hook = hook
    yield eng
    eng.stop()
    model.close()


def run(engine, prompt, max_tokens=16, sampling=GREEDY, stop=()):
    """Submit and wait; returns (text, events)."""
    q = queue.Queue()
    engine.submit(GenerationRequest(prompt, max_tokens, sampling, tuple(stop)), q.put)
    events = []
    while True:
        ev = q.get(timeout=300)
        events.append(ev)
        if isinstance(ev, (Finished, Failed)):
            return "".join(e.text for e in events if isinstance(e, Delta)), events


# -- text streaming (pure) -------------------------------------------------------
def test_utf8_split_across_tokens_is_held_until_complete():
    ts = TextStream(())
    data = "東京🙂".encode()
    out = [ts.push(data[i:i + 1]) for i in range(len(data))]
    assert "".join(out) + ts.flush() == "東京🙂"
    assert all("\ufffd" not in piece for piece in out)
    assert out[0] == "" and out[2] == "東"


def test_stop_string_split_across_pushes_is_never_emitted():
    ts = TextStream(("END",))
    emitted = ts.push(b"abc E") + ts.push(b"N")
    assert not ts.stopped and emitted == "abc "
    emitted += ts.push(b"D and more")
    assert ts.stopped and emitted == "abc "


def test_held_back_prefix_is_released_when_it_diverges():
    ts = TextStream(("END",))
    assert ts.push(b"x EN") == "x "
    assert ts.push(b"O") == "ENO"
    assert not ts.stopped


# -- the engine -------------------------------------------------------------------
def test_greedy_request_admitted_then_finished(engine):
    text, events = run(engine, CHAT.format("What is the capital of France?"), 24)
    assert isinstance(events[0], Admitted) and events[0].adapter_version == 0
    fin = events[-1]
    assert isinstance(fin, Finished) and fin.completion_tokens <= 24
    assert "Paris" in text


def test_prompt_extending_a_slot_cache_reuses_it(engine):
    prompt = CHAT.format("Name three colours.")
    a, ev_a = run(engine, prompt, 12)
    b, ev_b = run(engine, prompt, 12)
    assert a == b
    # Everything but the last prompt token comes from the cache the first run left.
    assert ev_b[0].cached_tokens == ev_b[0].prompt_tokens - 1


def test_a_memory_that_cannot_drop_a_tail_decodes_the_prompt_whole(engine, monkeypatch):
    """Where llama_memory_seq_rm refuses to drop a sequence's tail (a recurrent state does), the
    cached prefix is not reused: the prompt is decoded whole and the answer is the same."""
    prompt = CHAT.format("Name three fruits.")
    a, _ = run(engine, prompt, 12)
    real, refused = engine.lc.llama_memory_seq_rm, []

    def whole_only(memory, seq, p0, p1):
        if p0 > 0:
            refused.append((seq, p0))
            return False
        return real(memory, seq, p0, p1)
    monkeypatch.setattr(engine.lc, "llama_memory_seq_rm", whole_only)
    b, ev_b = run(engine, prompt, 12)
    monkeypatch.undo()
    assert refused and ev_b[0].cached_tokens == 0 and b == a
    c, ev_c = run(engine, prompt, 12)
    assert c == a and ev_c[0].cached_tokens == ev_c[0].prompt_tokens - 1


def test_conversations_one_at_a_time_keep_their_own_slots(engine):
    """Two conversations taking turns, one request at a time: a new conversation takes an
    empty slot rather than give up the other's cache for the chat template's shared
    header, so each next turn continues its own cache."""
    engine.forget_cached_prefixes()
    first = {k: CHAT.format(q) for k, q in (("x", "Name a river."), ("y", "Name a mountain."))}
    runs = {k: run(engine, p, 6) for k, p in first.items()}
    for k, p in first.items():
        answer, events = runs[k]
        nxt = p + answer + "<|im_end|>\n<|im_start|>user\nAnd another?<|im_end|>\n<|im_start|>assistant\n"
        _, ev = run(engine, nxt, 4)
        # the first turn's prompt and most of its answer come from this conversation's own slot
        # (the answer's last token or two may tokenize differently inside the longer text)
        assert ev[0].cached_tokens >= events[0].prompt_tokens + 6 - 2, (k, events[0], ev[0])


def test_stop_string_ends_generation_without_emitting_it(engine):
    full, _ = run(engine, CHAT.format("What is the capital of France?"), 24)
    assert "Paris" in full
    text, events = run(engine, CHAT.format("What is the capital of France?"), 24, stop=["Paris"])
    assert events[-1].finish_reason == "stop"
    assert "Paris" not in text and full.startswith(text)


def test_max_tokens_gives_length(engine):
    _, events = run(engine, "Once upon a time", 5)
    assert events[-1].finish_reason == "length" and events[-1].completion_tokens == 5


def test_seeded_sampling_is_reproducible(engine):
    p = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1,
                       frequency_penalty=0.2, presence_penalty=0.2, seed=1234)
    a, _ = run(engine, "The weather today is", 20, p)
    b, _ = run(engine, "The weather today is", 20, p)
    assert a == b and a


def test_grammar_constrains_output(engine):
    g = 'root ::= "yes" | "no"'
    text, events = run(engine, CHAT.format("Is water wet? Answer yes or no."), 8,
                       SamplingParams(temperature=0.0, grammar=g))
    assert text in ("yes", "no")
    assert events[-1].finish_reason == "stop"


def test_json_schema_grammar_gives_valid_json(engine):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
    sp = SamplingParams(temperature=0.0, grammar=json_schema_grammar(schema))
    text, events = run(engine, CHAT.format("Give the capital of France as JSON."), 40, sp)
    assert events[-1].finish_reason == "stop"
    assert isinstance(json.loads(text)["city"], str)


def test_bad_grammar_is_a_400(engine):
    _, events = run(engine, "hi", 4, SamplingParams(grammar="root ::= ( unclosed"))
    assert isinstance(events[-1], Failed) and events[-1].status == 400 and events[-1].param == "grammar"


def test_prompt_plus_max_tokens_beyond_slot_budget_is_a_400(engine):
    assert engine.slot_ctx == 1024 // 4
    _, events = run(engine, "hello", engine.slot_ctx)
    assert isinstance(events[-1], Failed) and events[-1].status == 400
    assert "max_tokens" in events[-1].message and str(engine.slot_ctx) in events[-1].message


def test_out_of_vocabulary_prompt_token_is_a_400(engine):
    _, events = run(engine, [1, 2, 10**9], 4)
    assert isinstance(events[-1], Failed) and events[-1].status == 400 and "vocabulary" in events[-1].message


def test_cancel_frees_the_slot(engine):
    q = queue.Queue()
    h = engine.submit(GenerationRequest("Count from one to one hundred:", 200, GREEDY), q.put)
    assert isinstance(q.get(timeout=300), Admitted)
    assert isinstance(q.get(timeout=300), Delta)
    h.cancel()
    while True:
        ev = q.get(timeout=300)
        if not isinstance(ev, Delta):
            break
    assert isinstance(ev, Failed) and ev.status == 499
    assert engine.busy_slots() == 0
    assert engine.stats.requests.get("cancelled", 0) >= 1


def test_queue_bound_raises_queue_full(engine):
    # 4 slots + a waiting room of 2: the 7th outstanding request is refused.
    qs, handles = [], []
    try:
        for _ in range(6):
            q = queue.Queue()
            handles.append(engine.submit(GenerationRequest("Tell me a long story.", 200, GREEDY), q.put))
            qs.append(q)
        with pytest.raises(QueueFull, match="slots busy"):
            engine.submit(GenerationRequest("one more", 4, GREEDY), lambda ev: None)
    finally:
        for h in handles:
            h.cancel()
    for q in qs:
        while not isinstance(q.get(timeout=300), (Finished, Failed)):
            pass
    assert engine.busy_slots() == 0 and engine.queue_depth == 0


def test_dream_hook_runs_after_every_decode_batch_and_when_idle(engine):
    hook = engine.test_hook
    before_calls = len([c for c in hook.calls if not c[0]])
    before_batches = engine.stats.decode_batches
    hook.batch_tokens.clear()
    run(engine, "Once upon a time", 6)
    busy_calls = [c for c in hook.calls if not c[0]][before_calls:]
    batches = engine.stats.decode_batches - before_batches
    assert batches >= 6
    # exactly one call per decode batch, each made after that batch counted
    assert len(busy_calls) == batches
    assert [b for _, b in busy_calls] == list(range(before_batches + 1, before_batches + batches + 1))
    # the hook sees what the batch held: the prompt first (no decode tokens), then one decode token each
    assert hook.batch_tokens[0][1] == 0 and hook.batch_tokens[0][0] >= 1
    assert all(t == (1, 1) for t in hook.batch_tokens[1:])
    hook.idle_seen.clear()
    assert hook.idle_seen.wait(60), "the idle engine never called the hook"
    assert engine.busy_slots() == 0


def test_a_failing_hook_does_not_stop_serving(engine):
    class Boom:
        def after_batch(self, engine, idle):
            raise RuntimeError("dream step failed")

    saved, engine.hook = engine.hook, Boom()
    try:
        before = engine.stats.hook_errors
        text, events = run(engine, "Once upon a time", 4)
        assert isinstance(events[-1], Finished) and events[-1].completion_tokens == 4
        assert engine.stats.hook_errors - before >= 4
    finally:
        engine.hook = saved


def test_quantized_serving_kv_type_generates():
    # --kv-type q8_0: a quantized V cache needs flash attention, which llama.cpp's auto setting enables.
    model = ResidentModel(ResidentConfig(n_ctx=512, n_seq=2, n_threads=1, kv_type="q8_0", kv_unified=False))
    eng = Engine(model).start()
    try:
        text, events = run(eng, "The capital of France is", 6)
        assert isinstance(events[-1], Finished) and events[-1].completion_tokens == 6
        assert "Paris" in text
    finally:
        eng.stop()
        model.close()


def test_a_context_smaller_than_the_batch_setting_prefills_long_prompts_in_decodes_llama_cpp_takes(tiny_model_path):
    """llama.cpp clamps n_batch to n_ctx; the engine's batches and a long
    greedy prompt keep to the clamped size (a larger decode aborts the process)."""
    model = ResidentModel(ResidentConfig(model_path=str(tiny_model_path), n_ctx=128, n_seq=2, n_batch=512,
                                         n_threads=1, kv_type="f32", flash_attn="off"))
    eng = Engine(model, max_queue=4).start()
    try:
        assert model.n_batch <= model.n_ctx < 512
        long = " ".join(["word"] * (eng.slot_ctx - 8))
        prompt_tokens = len(model.tokenize(long))
        assert 2 * prompt_tokens > model.n_batch       # two such prefills do not fit one decode
        results = []
        threads = [threading.Thread(target=lambda: results.append(run(eng, long, max_tokens=2))) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert len(results) == 2 and all(isinstance(ev[-1], Finished) for _, ev in results)
        assert eng.stats.decode_batches >= 3            # the two prompts took more than one decode
    finally:
        eng.stop()
    model.close()
    big = ResidentModel(ResidentConfig(model_path=str(tiny_model_path), n_ctx=256, n_seq=1, n_batch=64,
                                       n_threads=1, kv_type="f32", flash_attn="off"))
    try:
        prompt = " ".join(["word"] * 150)
        assert len(big.tokenize(prompt)) > big.n_batch
        assert isinstance(big.generate_greedy(prompt, max_tokens=4), str)
    finally:
        big.close()


def test_log_softmax_keeps_masked_tokens_at_minus_infinity_and_an_all_masked_row_without_nan():
    import warnings

    import numpy as np

    from dreamstage.serving.sampling import log_softmax
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # no RuntimeWarning from a row with no finite logit
        lp = log_softmax(np.array([2.0, -np.inf, 0.0]))
        assert lp[1] == -np.inf and np.exp(lp[[0, 2]]).sum() == pytest.approx(1.0)
        assert np.all(log_softmax(np.full(3, -np.inf)) == -np.inf)
