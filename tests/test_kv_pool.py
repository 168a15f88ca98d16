"""A unified K/V pool (serve --kv-unified): the slots share one context, as llama-server's do.

One server for the module: a pool of 256 cells (llama.cpp's smallest) for 4
slots (64 each, were they split). Token-id prompts with distinct first tokens share no prefix, so
each test knows what the slots hold.
"""
import threading

import httpx
import pytest
from background_server import BackgroundServer
from drift_steps import run_steps

from dreamstage.server.settings import ServerSettings
from dreamstage.serving.engine import Engine, RequestHandle
from dreamstage.serving.generation import Admitted, Delta, Failed, Finished, GenerationRequest
from dreamstage.serving.resident import ResidentConfig, ResidentModel
from dreamstage.serving.sampling import SamplingParams
from dreamstage.serving.slots import _Job
from dreamstage.training.drift.decoding import Decoder

POOL, SLOTS = 256, 4
PROMPTS = ["What is the capital of France?", "Write a haiku about snow.", "List three fruits.",
           "Why is the sky blue?"]


@pytest.fixture(scope="module")
def server():
    with BackgroundServer(ServerSettings(ctx=POOL, parallel=SLOTS, threads=1, kv_unified=True, max_queue=8)) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def words(server):
    return server.service.model.tokenize(" the quick brown fox jumps over the lazy dog and runs far away",
                                         add_special=False)


def tokens(words, first, n):
    """n token ids starting with `first` (no two prompts of this module share a first token)."""
    return [first] + [words[i % len(words)] for i in range(n - 1)]


def complete(c, prompt, max_tokens, **kw):
    r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def slots(http):
    return http.get("/slots").json()


def test_one_request_uses_more_than_its_share_while_another_is_short(server, http, words):
    info = slots(http)
    assert info["slot_context"] == POOL and info["context"]["kv_unified"] is True
    assert info["context"]["pool"]["cells"] == POOL
    got = {}

    def long():
        with httpx.Client(base_url=server.url, timeout=300) as c:
            got["long"] = complete(c, tokens(words, 100, 100), 4)

    t = threading.Thread(target=long)
    t.start()
    got["short"] = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                           "max_tokens": 4, "temperature": 0}).json()
    t.join()
    assert got["long"]["usage"]["prompt_tokens"] == 100 > POOL // SLOTS
    assert got["short"]["usage"]["completion_tokens"] >= 1
    # beyond the whole context: a 400 that names the numbers
    r = http.post("/v1/completions", json={"prompt": tokens(words, 101, 250), "max_tokens": 100})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and "250 tokens" in err["message"] and f"{POOL} tokens" in err["message"]


def test_requests_whose_reservations_exceed_the_pool_wait_then_finish(server, words):
    engine = server.service.engine
    greedy = SamplingParams(temperature=0.0)
    seen = []                # (request, event) in the order the engine thread sent them
    done = threading.Semaphore(0)

    def submit(name, prompt):
        def sink(ev):
            seen.append((name, ev))
            if isinstance(ev, (Finished, Failed)):
                done.release()
        engine.submit(GenerationRequest(prompt, 8, greedy), sink)

    def run(first, n):
        seen.clear()
        with engine._cond:               # both reach the engine's inbox in one iteration
            submit("a", tokens(words, first, n))
            submit("b", tokens(words, first + 1, n))
        for _ in range(2):
            assert done.acquire(timeout=300)
        ends = [ev for _, ev in seen if isinstance(ev, (Finished, Failed))]
        assert all(isinstance(ev, Finished) and ev.completion_tokens == 8 for ev in ends), ends
        return [(name, type(ev).__name__) for name, ev in seen if isinstance(ev, (Admitted, Finished))]

    # 2 x (130 + 8) > 256 cells: b waits for a, then runs to its end
    assert run(200, 130) == [("a", "Admitted"), ("a", "Finished"), ("b", "Admitted"), ("b", "Finished")]
    # two that fit run together
    assert run(300, 30)[:2] == [("a", "Admitted"), ("b", "Admitted")]


def test_idle_prefixes_are_evicted_least_recent_first_and_reused_while_there_is_room(http, words):
    def cached(first, n, max_tokens=1):
        return complete(http, tokens(words, first, n), max_tokens)["usage"]["prompt_tokens_details"]["cached_tokens"]

    def evicted():
        return slots(http)["context"]["pool"]["evicted_prefixes"]

    cached(400, 250)                     # one prefix of 250 cells: nothing else stays beside it
    before = evicted()
    assert cached(401, 75) == 0 and evicted() > before         # P1 needs room: the 250 go
    assert [s["cached_tokens"] for s in slots(http)["slots"] if s["cached_tokens"]] == [75]
    assert cached(402, 75) == 0                                 # P2 fits beside P1
    assert cached(401, 75) == 74                                # P1 again: its prefix reused, now the newer
    before = evicted()
    assert cached(403, 150, max_tokens=10) == 0                 # 150 cached + 160 > 256: one prefix goes
    assert evicted() == before + 1
    assert cached(401, 75) == 74                                # the recent one stayed
    assert cached(402, 75) == 0                                 # the least recent went
    pool = slots(http)["context"]["pool"]
    assert pool["reserved"] == 0 and pool["free"] == POOL - pool["cached"]


def test_greedy_answers_equal_the_per_slot_stream_servers_one_at_a_time(http, words):
    # Alone on an empty pool a request meets the kernels it meets on a stream of its own, so the
    # arithmetic is the same. Batched with others it need not be (docs/architecture/serving.md,
    # "K/V layout": the reason --kv-unified is not the default; bench/kv_layout.py measures it).
    def chat(c, content):
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                 "temperature": 0, "max_tokens": 24})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    complete(http, tokens(words, 500, POOL - 1), 1)     # takes the whole pool: every other prefix goes
    pooled = [chat(http, p) for p in PROMPTS]           # the first of these evicts that one too
    with BackgroundServer(ServerSettings(ctx=4 * POOL, parallel=SLOTS, threads=1)) as streams:   # 256 a slot
        assert streams.service.engine.pool is None and streams.service.engine.slot_ctx == POOL
        with httpx.Client(base_url=streams.url, timeout=300) as c:
            own = [chat(c, p) for p in PROMPTS]
    assert pooled == own and all(own)


def test_a_lent_sequence_reserves_its_positions_and_serving_takes_the_room_back():
    model = ResidentModel(ResidentConfig(n_ctx=512, n_seq=2, n_threads=1, kv_unified=True))
    try:
        engine = Engine(model)           # not started: the test is the engine thread
        busy, idle = engine.slots
        busy.job, busy.reserved = object(), 400
        lease = engine.hold_idle_sequence()
        assert lease.seq_id == idle.seq_id
        assert lease.reserve(100) and engine.pool_info()["lent"] == 100
        # the borrower's own positions before `keep` stay; a refused reservation drops them
        dec = Decoder(model, lease.seq_id)
        run_steps(dec.forced_units(list(range(1, 21)), 19, keep=16))
        dec.close()

        def last():
            return model.lc.llama_memory_seq_pos_max(model.memory, lease.seq_id)
        assert last() == 15 and lease.reserve(100, keep=16) and last() == 15
        assert not lease.reserve(200, keep=16) and lease.valid and last() == -1   # 400 + 200 > 512: ask again later
        with pytest.raises(ValueError, match="512"):
            lease.reserve(600)
        busy.job, busy.reserved = None, 0
        assert lease.reserve(300)
        events = []
        engine._waiting.append(_Job(RequestHandle(engine, 1), GenerationRequest(prompt=[1, 2, 3], max_tokens=300),
                                    events.append, 0.0, prompt=[1, 2, 3], max_tokens=300))
        engine._admit()                  # 300 lent + 303 > 512: the loan ends, the request goes in
        assert not lease.valid and isinstance(events[0], Admitted) and engine.pool_info()["lent"] == 0
        assert engine.pool_info()["reserved"] == 303
        engine._free_slot(busy if busy.busy else idle)
    finally:
        model.close()


def test_the_switch_is_read_in_one_place_and_the_automatic_context_sizes_one_pool(server, monkeypatch):
    from dreamstage import cli, info
    from dreamstage.default_model import default_model_path
    from dreamstage.serving import resident

    def settings(*flags):
        return cli.serve_settings(cli.build_parser().parse_args(["serve", "--no-train", *flags]))

    monkeypatch.delenv("DREAMSTAGE_KV_UNIFIED", raising=False)
    assert settings().kv_unified is False and settings().resident_config().kv_unified is False
    assert settings("--kv-unified").resident_config().kv_unified is True
    monkeypatch.setenv("DREAMSTAGE_KV_UNIFIED", "true")
    assert settings().kv_unified is True and settings("--no-kv-unified").kv_unified is False
    got = info.serving_defaults(default_model_path())       # what `serve` would plan, with the variable
    ctx = got["context"]
    assert ctx["kv_unified"] is True and ctx["n_ctx"] == ctx["slot_ctx"] <= ctx["n_ctx_train"]
    assert f"serve context    {ctx['slot_ctx']} tokens shared by {got['slots']} slots (one K/V pool" in (
        info.render({**info.collect(), "serving": got}))

    # a memory share that holds 9.5 steps of cells: two streams get 4 steps each, one pool 9
    cell, available = server.service.model.kv_cell_bytes(), 2 << 30
    monkeypatch.setattr(resident, "host_available_bytes", lambda: available)
    share = 9.5 * resident.AUTO_CTX_STEP * cell / (available - server.service.model.output_rows_bytes(512))
    for unified, slot, total in ((False, 4, 8), (True, 9, 9)):
        model = ResidentModel(ResidentConfig(n_ctx=0, n_seq=2, n_threads=1, kv_unified=unified,
                                             auto_ctx_memory_share=share))
        try:
            plan, step = model.context_plan, resident.AUTO_CTX_STEP
            assert (plan.slot_ctx, plan.n_ctx, plan.chosen_by) == (slot * step, total * step, "memory")
            assert (model.n_ctx, model.lc.llama_n_ctx_seq(model.ctx)) == (total * step, slot * step)
            assert plan.kv_mib == pytest.approx(total * step * cell / 2**20, abs=0.1)
        finally:
            model.close()


def test_the_drift_probe_waits_for_room_in_the_pool_then_records_and_measures_zero_drift():
    from dreamstage.training.drift.anchors import load_anchors
    from dreamstage.training.drift.measure import DriftProbe

    model = ResidentModel(ResidentConfig(n_ctx=256, n_seq=2, n_threads=1, kv_unified=True))
    try:
        engine = Engine(model)           # not started: the test is the engine thread
        busy = engine.slots[0]
        busy.job, busy.reserved = object(), 250
        probe = DriftProbe(model, load_anchors()[:1], seq_id=engine.hold_idle_sequence, step_ms=None)
        record = probe.record()
        for _ in range(3):               # 250 reserved: no room for the anchor, nothing decoded
            next(record)
            assert engine._lease is not None and engine._lease.cells == 0 and not probe.bases
        busy.job, busy.reserved = None, 0
        for _ in record:
            assert engine._lease is None or engine._lease.cells >= len(probe.bases[0].forced if probe.bases else ())
        base = probe.bases[0]
        assert len(base.answer) > 0
        # a cached prefix on the other slot takes the pool's first cells: the probe's land after it
        cached = model.tokenize("The quick brown fox jumps over the lazy dog. " * 4)[:37]
        model.decode_entries([(t, i, busy.seq_id, False) for i, t in enumerate(cached)])
        busy.tokens[:] = cached
        measure = probe.measure(None)    # the adapter off: at the drift floor still
        while True:
            try:
                next(measure)
            except StopIteration as stop:
                drift = stop.value
                break
        assert drift.drift_kl < 1e-6 and drift.changed == 0 and drift.tokens > 0     # as tests/test_drift.py
        assert engine._lease is None and engine.pool_info()["lent"] == 0
    finally:
        model.close()


def test_the_default_layout_answers_alike_alone_and_in_one_batch():
    # serve's default settings; 4 chats (the default system turn included) prefilled in one batch.
    # A pool would fail this (bench/kv_layout.py: 1 of 4 alike), which is why it is not the default.
    chat = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
    model = ResidentModel(ServerSettings(ctx=4 * POOL, parallel=SLOTS, threads=1).resident_config())
    engine = Engine(model).start()
    try:
        def submit(p):
            got, done = [], threading.Event()
            engine.submit(GenerationRequest(chat.format(p), 24, SamplingParams(temperature=0.0)),
                          lambda ev: (got.append(ev), isinstance(ev, (Finished, Failed)) and done.set()))
            return got, done

        def text(pending):
            got, done = pending
            assert done.wait(300) and isinstance(got[-1], Finished), got[-1:]
            return "".join(ev.text for ev in got if isinstance(ev, Delta))

        alone = [text(submit(p)) for p in PROMPTS]
        with engine._cond:               # all 4 reach the engine's inbox in one iteration
            pending = [submit(p) for p in PROMPTS]
        together = [text(x) for x in pending]
        assert together == alone and all(alone)
    finally:
        engine.stop()
        model.close()
