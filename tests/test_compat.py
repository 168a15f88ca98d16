"""Compatibility with llama-server and vLLM clients (issue 47), against a live server with the openai SDK."""
from __future__ import annotations

import json
import math
import queue
import re

import httpx
import jsonschema_rs
import numpy as np
import openai
import pytest
from background_server import BackgroundServer

from dreamstage.server.settings import ServerSettings
from dreamstage.serving.chat import ChatTemplate
from dreamstage.serving.engine import Delta, Finished, GenerationRequest
from dreamstage.serving.resident import AUTO_CTX_STEP, ResidentConfig, ResidentModel
from dreamstage.serving.sampling import SamplingParams, defaults_source, model_defaults

ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    # 3 slots (n = 3) of 512 tokens: a completion that runs to the context's end stays short
    with BackgroundServer(ServerSettings(ctx=1536, parallel=3, threads=1, max_queue=4)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


def engine_tokens(server, prompt: str, max_tokens: int, **request) -> tuple[list[int], Finished]:
    """Greedy tokens straight from the engine, with the ids the HTTP answer does not carry."""
    events: queue.Queue = queue.Queue()
    server.service.engine.submit(GenerationRequest(prompt, max_tokens, SamplingParams(temperature=0), **request),
                                 events.put)
    tokens = []
    while True:
        ev = events.get(timeout=300)
        if isinstance(ev, Delta):
            tokens.append(ev.token)
        elif isinstance(ev, Finished):
            return [t for t in tokens if t >= 0], ev


# -- a tolerant schema ---------------------------------------------------------------
def test_unknown_fields_are_ignored_and_named_in_a_header(client):
    raw = client.chat.completions.with_raw_response.create(
        model="base", messages=[{"role": "user", "content": "Hi", "reasoning_content": "x"}], max_tokens=4,
        temperature=0, extra_body={"frobnicate": 1, "skip_special_tokens": False, "cache_prompt": True,
                                   "bad\nname\u00e9": 2})
    assert raw.http_response.status_code == 200
    named = raw.headers["x-dreamstage-ignored-fields"].split(", ")
    # honoured extras (cache_prompt) are not in it; ignored extras and unknown ones are, nested paths too
    assert set(named) == {"frobnicate", "skip_special_tokens", "messages[0].reasoning_content",
                          "bad%0Aname%C3%A9"}
    assert raw.parse().choices[0].message.content
    plain = client.chat.completions.with_raw_response.create(model="base", messages=ASK, max_tokens=2)
    assert "x-dreamstage-ignored-fields" not in plain.headers


def test_min_tokens_holds_off_the_end_and_the_stop_strings(client, http):
    """vLLM's min_tokens: greedy, the answer is the natural one up to where it ended, then goes on to at
    least min_tokens; a stop string inside the first min_tokens tokens does not end it."""
    ask = dict(model="base", messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=64)
    natural = client.chat.completions.create(**ask)
    n, text = natural.usage.completion_tokens, natural.choices[0].message.content
    assert natural.choices[0].finish_reason == "stop" and 2 < n < 40, natural
    longer = client.chat.completions.create(**ask, extra_body={"min_tokens": n + 8})
    assert longer.usage.completion_tokens >= n + 8 and longer.choices[0].message.content.startswith(text)
    word = text.split()[0]
    cut = client.chat.completions.create(**ask, stop=[word])
    assert cut.choices[0].message.content == text[:text.index(word)]
    held = client.chat.completions.create(**ask, stop=[word], extra_body={"min_tokens": n})
    assert held.choices[0].message.content.startswith(text[:-1]) and held.usage.completion_tokens >= n
    r = http.post("/v1/chat/completions", json={**ask, "max_tokens": 4, "min_tokens": 5})
    assert r.status_code == 400 and "min_tokens" in r.json()["error"]["message"], r.text


def test_a_grammar_that_allows_only_banned_tokens_ends_the_answer_not_the_server(server, http):
    """Once a grammar is complete it allows only an end-of-generation token; banning those (logit_bias, or
    min_tokens) left no token to draw, and llama.cpp's grammar aborted the process. A ban is finite now:
    the grammar's end wins."""
    bans = {str(t): -100 for t in server.service.model.eog_tokens}
    for extra in ({"logit_bias": bans}, {"min_tokens": 5}, {"logit_bias": bans, "temperature": 1.0}):
        r = http.post("/v1/completions", json={"prompt": "Yes or no?", "max_tokens": 8,
                                               "guided_choice": ["yes"], **extra})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "yes", (extra, r.text)
    scored = http.post("/v1/completions", json={"prompt": "Yes or no?", "max_tokens": 8, "logprobs": 2,
                                                "grammar": 'root ::= "yes"', "logit_bias": bans}).json()
    assert all(-9999.0 <= x <= 0.0 for x in scored["choices"][0]["logprobs"]["token_logprobs"])
    # a grammar no token of this vocabulary continues past its fourth character (found by the fuzz):
    # a 400 naming the grammar, whole or streamed, with or without logprobs; the server serves on
    dead = {"prompt": "a", "max_tokens": 8, "grammar": 'root ::= "-" "\u00ba" "\\x0F" "\U000b0cb2"'}
    for extra in ({}, {"logprobs": 1}):
        r = http.post("/v1/completions", json={**dead, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "grammar", r.text
    streamed = http.post("/v1/completions", json={**dead, "stream": True}).text
    assert '"param":"grammar"' in streamed and "[DONE]" not in streamed
    # the field the grammar came from is the one named
    for body, param in (({"guided_choice": ["-\u00ba\x0f\U000b0cb2"]}, "guided_choice"),
                        ({"guided_regex": "a{1000000}"}, "guided_regex")):
        r = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 8, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert http.get("/health").json()["status"] == "ok"


def test_what_the_table_says_is_not_served_is_named_or_404(http):
    """README's compatibility table: vLLM's beam and prompt-scoring fields are ignored (and named),
    llama-server's own non-OpenAI routes are not served."""
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "guided_decoding_backend": "xgrammar",
                                           "best_of": 2, "use_beam_search": False, "prompt_logprobs": 1})
    assert r.status_code == 200
    assert set(r.headers["x-dreamstage-ignored-fields"].split(", ")) == {"guided_decoding_backend", "best_of",
                                                                          "use_beam_search", "prompt_logprobs"}
    for route in ("/completion", "/embedding", "/infill", "/rerank", "/apply-template"):
        assert http.post(route, json={"prompt": "Hi"}).status_code == 404, route


def test_the_header_is_bounded(http):
    body = {"prompt": "Hi", "max_tokens": 1, **{f"f{i}": i for i in range(40)}}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200
    assert r.headers["x-dreamstage-ignored-fields"].endswith("+24 more")


def test_strict_api_restores_the_400s():
    with BackgroundServer(ServerSettings(ctx=512, parallel=1, threads=1, strict_api=True)) as srv:
        with httpx.Client(base_url=srv.url, timeout=300) as http:
            for route, body in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": "a"})):
                r = http.post(route, json={**body, "max_token": 5})
                assert r.status_code == 400, r.text
                assert r.json()["error"]["param"] == "max_token" and "max_token" in r.json()["error"]["message"]
            r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x", "foo": 1}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].foo"
            # the anchors' own extras are accepted even so
            r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, "n_probs": 0,
                                                        "skip_special_tokens": True, "cache_prompt": False})
            assert r.status_code == 200
            assert set(r.headers["x-dreamstage-ignored-fields"].split(", ")) == {"skip_special_tokens", "n_probs"}


def test_n_predict_bounds_the_answer(client):
    done = client.completions.create(model="base", prompt="Once upon a time", temperature=0,
                                     extra_body={"n_predict": 5, "ignore_eos": True})
    assert done.usage.completion_tokens == 5 and done.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model="base", messages=ASK, temperature=0,
                                          extra_body={"n_predict": 3, "ignore_eos": True})
    assert chat.usage.completion_tokens == 3
    # max_tokens wins over n_predict when both are given
    both = client.completions.create(model="base", prompt="Once upon a time", temperature=0, max_tokens=2,
                                     extra_body={"n_predict": 9, "ignore_eos": True})
    assert both.usage.completion_tokens == 2


def test_repetition_penalty_is_repeat_penalty(client, http):
    def ask(**extra):
        return client.completions.create(model="base", prompt="one one one one one", max_tokens=12, temperature=0,
                                         extra_body=extra).choices[0].text
    plain, vllm, ours = ask(), ask(repetition_penalty=1.8), ask(repeat_penalty=1.8)
    assert vllm == ours != plain
    r = http.post("/v1/completions", json={"prompt": "a", "repeat_penalty": 1.1, "repetition_penalty": 1.2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty"


def test_stop_token_ids_end_the_answer_before_that_token(server, client):
    prompt = "The days of the week are Monday,"
    tokens, _ = engine_tokens(server, prompt, 8)
    assert len(tokens) == 8
    stop_at = next(i for i in range(2, 8) if tokens[i] not in tokens[:i])
    done = client.completions.create(model="base", prompt=prompt, max_tokens=8, temperature=0,
                                     extra_body={"stop_token_ids": [tokens[stop_at]]})
    assert done.choices[0].finish_reason == "stop"
    assert done.usage.completion_tokens == stop_at + 1      # the stop token was sampled, not emitted
    assert done.choices[0].text == server.service.model.detokenize(tokens[:stop_at])


def test_ignore_eos_runs_past_the_end_of_turn(server, client):
    tokens, fin = engine_tokens(server, "<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\n", 64)
    assert fin.finish_reason == "stop" and fin.completion_tokens < 64
    _, fin = engine_tokens(server, "<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\n", 64,
                           ignore_eos=True)
    assert fin.finish_reason == "length" and fin.completion_tokens == 64


def test_cache_prompt_false_evaluates_the_whole_prompt(client):
    long_ask = [{"role": "user", "content": "Describe the history of Paris in one paragraph."}]
    client.chat.completions.create(model="base", messages=long_ask, max_tokens=1, temperature=0)
    again = client.chat.completions.create(model="base", messages=long_ask, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    fresh = client.chat.completions.create(model="base", messages=long_ask, max_tokens=1, temperature=0,
                                           extra_body={"cache_prompt": False})
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0


def test_typical_p_keeps_the_draw_to_one_token(client):
    def draw(seed, **extra):
        return client.completions.create(model="base", prompt="My favourite animal is the", max_tokens=8,
                                         temperature=1.0, seed=seed, extra_body=extra).choices[0].text
    free = {draw(s) for s in range(4)}
    assert len(free) > 1
    assert len({draw(s, typical_p=1e-6) for s in range(4)}) == 1


def test_chat_template_kwargs_reach_the_template(client):
    t = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}|{{ flavour }}|{{ bos_token }}", "<s>",
                     "</s>")
    assert t.render([{"role": "user", "content": "hi"}], {"flavour": "mint", "bos_token": "forged"}) == "hi|mint|<s>"
    r = client.chat.completions.create(model="base", messages=ASK, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content is not None


# -- context and defaults ------------------------------------------------------------
def test_default_context_is_the_trained_context_and_holds_a_long_conversation():
    with BackgroundServer(ServerSettings(parallel=1, threads=1)) as srv:
        model = srv.service.model
        assert model.n_ctx_train == int(model.meta("llama.context_length"))
        with httpx.Client(base_url=srv.url, timeout=600) as http:
            slots = http.get("/slots").json()
            assert slots["slot_context"] == slots["n_ctx_train"] == model.n_ctx_train
            assert (slots["context"]["chosen_by"], slots["context"]["slot_ctx"]) == ("trained", model.n_ctx_train)
            assert slots["sampling_defaults_source"].startswith("llama-server's")
            assert http.get("/props").json()["default_generation_settings"]["n_ctx"] == model.n_ctx_train
            # a conversation past ResidentConfig's own 4,096-token context (about 4,200 tokens), answered
            turns = []
            for i in range(39):
                turns += [{"role": "user", "content": f"Note {i}: " + "the river runs past the old mill " * 12},
                          {"role": "assistant", "content": f"Noted {i}."}]
            turns.append({"role": "user", "content": "What was the first note about?"})
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=600)
            done = client.chat.completions.create(model="base", messages=turns, max_tokens=8, temperature=0)
            assert ResidentConfig.n_ctx < done.usage.prompt_tokens < model.n_ctx_train
            assert done.choices[0].message.content
            r = http.post("/v1/chat/completions", json={"messages": turns * 2, "max_tokens": 8})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
            assert str(model.n_ctx_train) in r.json()["error"]["message"]


def test_the_automatic_context_is_capped_by_memory(monkeypatch):
    from dreamstage.serving import resident
    probe = ResidentModel(ResidentConfig(n_ctx=512, n_seq=1, n_threads=1))
    try:
        cell, reserve = probe.kv_cell_bytes(), probe.output_rows_bytes(512)
    finally:
        probe.close()
    # the host's available memory (not ggml's CPU figure, its total) is what the K/V may take a share of,
    # less what the output buffer may still grow to
    available = 2 << 30
    monkeypatch.setattr(resident, "host_available_bytes", lambda: available)
    # a share that fits about 4.5 steps of cells for each of 2 slots: each slot gets 4 steps
    share = 4.5 * AUTO_CTX_STEP * 2 * cell / (available - reserve)
    capped = ResidentModel(ResidentConfig(n_ctx=0, n_seq=2, n_threads=1, kv_unified=False,
                                          auto_ctx_memory_share=share))
    try:
        assert capped.lc.llama_n_ctx_seq(capped.ctx) == 4 * AUTO_CTX_STEP < capped.n_ctx_train
        plan = capped.context_plan
        assert (plan.slot_ctx, plan.chosen_by, plan.kv_device) == (4 * AUTO_CTX_STEP, "memory", "CPU")
        assert plan.available_mib == available / 2**20
        assert plan.kv_mib == pytest.approx(8 * AUTO_CTX_STEP * cell / 2**20, abs=0.1)
    finally:
        capped.close()


def test_info_says_the_context_and_the_sampling_defaults_serve_gets():
    from dreamstage import info
    from dreamstage.default_model import default_model_path
    got = info.serving_defaults(default_model_path())
    ctx = got["context"]
    assert (got["slots"], ctx["n_ctx_train"]) == (ServerSettings().parallel, 8192)
    assert ctx["chosen_by"] in ("trained", "memory") and ctx["slot_ctx"] <= 8192 and ctx["kv_mib"] > 0
    assert got["sampling"]["temperature"] == SamplingParams().temperature and "llama-server" in got["sampling_source"]
    text = info.render({**info.collect(), "serving": got})
    assert f"serve context    {ctx['slot_ctx']} tokens per slot x {got['slots']} slots" in text
    assert "serve sampling   temperature 0.8, top_k 40" in text


def test_too_long_a_request_is_a_400_naming_the_numbers(server, http, client):
    slot = server.service.engine.slot_ctx
    # a vLLM client learns the limit from the model list
    assert [m.model_extra["max_model_len"] for m in client.models.list().data] == [slot]
    r = http.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": slot})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    msg = r.json()["error"]["message"]
    assert str(slot) in msg and f"max_tokens ({slot})" in msg
    r = http.post("/v1/completions", json={"prompt": [1] * (slot + 1)})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt" and str(slot + 1) in err["message"]


def test_completions_without_max_tokens_run_to_the_context_end(server, client):
    slot = server.service.engine.slot_ctx
    # a prompt that leaves 12 tokens of room: decoding it in batches is quicker than generating the room
    prompt = (server.service.model.tokenize("Once upon a time " * slot, True, False))[:slot - 12]
    done = client.completions.create(model="base", prompt=prompt, temperature=0, extra_body={"ignore_eos": True})
    assert done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (slot - 12, 12)


def test_sampling_defaults_are_llama_servers_unless_the_gguf_says(server, client, http):
    assert model_defaults(server.service.model.meta) == SamplingParams()   # this GGUF has no sampling keys
    props = http.get("/props").json()
    params = props["default_generation_settings"]["params"]
    assert "no general.sampling" in props["sampling_defaults_source"]
    assert http.get("/slots").json()["context"]["chosen_by"] == "ctx"       # --ctx was given
    assert (params["temperature"], params["top_k"], params["top_p"], params["min_p"]) == (0.8, 40, 0.95, 0.05)
    meta = {"general.sampling.temp": "0.3", "general.sampling.top_k": "20", "general.sampling.min_p": "oops"}
    own = model_defaults(meta.get)
    assert (own.temperature, own.top_k, own.min_p, own.top_p) == (0.3, 20, SamplingParams().min_p, 0.95)
    assert defaults_source(meta.get) == ("the GGUF's general.sampling.* for temperature, top_k; "
                                         "llama-server's for the rest")

    def draw(seed, **fields):
        return client.completions.create(model="base", prompt="My favourite animal is the", max_tokens=16,
                                         seed=seed, extra_body=fields).choices[0].text
    explicit = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
    unfiltered = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    seeds = range(3)
    assert [draw(s) for s in seeds] == [draw(s, **explicit) for s in seeds]
    assert [draw(s) for s in seeds] != [draw(s, **unfiltered) for s in seeds]


# -- /tokenize and /detokenize ----------------------------------------------------------
def test_tokenize_and_detokenize_round_trip_in_llama_servers_shapes(server, http):
    model = server.service.model
    text = "Héllo <|im_start|> wörld"
    toks = http.post("/tokenize", json={"content": text}).json()["tokens"]
    assert toks == model.tokenize(text, add_special=False, parse_special=True)
    im_start = model.tokenize("<|im_start|>", add_special=False, parse_special=True)
    assert len(im_start) == 1 and im_start[0] in toks          # parsed as the control token by default
    plain = http.post("/tokenize", json={"content": text, "parse_special": False}).json()["tokens"]
    assert im_start[0] not in plain and len(plain) > len(toks)
    assert http.post("/detokenize", json={"tokens": toks}).json() == {"content": text}
    # mixed content: text pieces and ids, in order
    mixed = http.post("/tokenize", json={"content": ["Hello", 42, " world"]}).json()["tokens"]
    assert mixed == model.tokenize("Hello", False, True) + [42] + model.tokenize(" world", False, True)
    assert http.post("/tokenize", json={}).json() == {"tokens": []}
    assert http.post("/detokenize", json={}).json() == {"content": ""}


def test_tokenize_with_pieces_gives_text_or_bytes(server, http):
    model = server.service.model
    out = http.post("/tokenize", json={"content": "naïve 龘", "with_pieces": True}).json()["tokens"]
    assert [t["id"] for t in out] == model.tokenize("naïve 龘", False, True)
    joined = b""
    for t in out:
        piece = t["piece"]
        assert isinstance(piece, str) or all(isinstance(b, int) and 0 <= b < 256 for b in piece)
        joined += piece.encode() if isinstance(piece, str) else bytes(piece)
    assert joined.decode() == "naïve 龘"
    assert any(isinstance(t["piece"], list) for t in out)   # 龘 spans tokens that are not UTF-8 alone


def test_tokenize_add_special_and_bad_ids(server, http):
    model = server.service.model
    with_bos = http.post("/tokenize", json={"content": "hi", "add_special": True}).json()["tokens"]
    assert with_bos == model.tokenize("hi", add_special=True, parse_special=True)
    for route, body, param in (("/detokenize", {"tokens": [1, model.n_vocab]}, "tokens[1]"),
                               ("/tokenize", {"content": ["a", model.n_vocab + 5]}, "content[1]"),
                               ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
                               ("/tokenize", {"content": 5}, "content")):
        r = http.post(route, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# -- logprobs ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference():
    """A second copy of the model, for the logits a server's logprobs must match."""
    model = ResidentModel(ResidentConfig(n_ctx=512, n_seq=1, n_threads=1))
    yield model
    model.close()


def reference_greedy(model, tokens: list[int], steps: int) -> list[tuple[int, np.ndarray]]:
    """(argmax token, log-softmax row) at each of `steps` greedy positions after `tokens`."""
    lc = model.lc
    lc.llama_memory_seq_rm(model.memory, 0, -1, -1)
    batch = lc.llama_batch_init(len(tokens) + steps, 0, 1)
    out, pending, pos = [], list(tokens), 0
    try:
        for _ in range(steps):
            batch.n_tokens = len(pending)
            for i, t in enumerate(pending):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, pos + i, 1
                batch.seq_id[i][0], batch.logits[i] = 0, i == len(pending) - 1
            assert lc.llama_decode(model.ctx, batch) == 0
            pos += len(pending)
            row = np.ctypeslib.as_array(lc.llama_get_logits_ith(model.ctx, len(pending) - 1),
                                        shape=(model.n_vocab,)).astype(np.float64)
            logp = row - np.logaddexp.reduce(row)
            best = int(row.argmax())
            out.append((best, logp))
            pending = [best]
    finally:
        lc.llama_batch_free(batch)
    return out


def test_completion_logprobs_match_the_models_logits(server, client, reference):
    prompt = "The three primary colours are"
    done = client.completions.create(model="base", prompt=prompt, max_tokens=6, temperature=0, logprobs=5,
                                     extra_body={"ignore_eos": True})
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == done.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    ref = reference_greedy(reference, reference.tokenize(prompt, True, False), 6)
    pieces = server.service.prompts.pieces
    for i, (best, logp) in enumerate(ref):
        assert lp.tokens[i] == pieces[best].decode("utf-8", "replace")
        assert lp.token_logprobs[i] == pytest.approx(logp[best], abs=2e-3)
        top = sorted(lp.top_logprobs[i].values(), reverse=True)
        assert len(top) == 5 and top[0] == pytest.approx(lp.token_logprobs[i], abs=1e-6)
        assert top == pytest.approx(sorted(logp, reverse=True)[:5], abs=2e-3)


def test_chat_logprobs_ordered_and_the_same_streamed(client):
    ask = dict(model="base", messages=ASK, max_tokens=8, temperature=0, logprobs=True, top_logprobs=4)
    done = client.chat.completions.create(**ask)
    content = done.choices[0].logprobs.content
    assert len(content) == done.usage.completion_tokens
    assert b"".join(bytes(e.bytes) for e in content).decode() == done.choices[0].message.content
    for e in content:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 4 and tops == sorted(tops, reverse=True)
        assert e.top_logprobs[0].token == e.token and e.logprob == tops[0] <= 0   # greedy: the most likely
        assert sum(math.exp(t) for t in tops) <= 1 + 1e-6
    streamed = []
    for chunk in client.chat.completions.create(**ask, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(model="base", messages=ASK, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_sampled_logprobs_are_of_the_distribution_before_truncation(client):
    # top_k 1 leaves one candidate, yet the reported distribution is the one before truncation
    done = client.chat.completions.create(model="base", messages=ASK, max_tokens=4, temperature=1.0, seed=3,
                                          logprobs=True, top_logprobs=3, extra_body={"top_k": 1})
    for e in done.choices[0].logprobs.content:
        assert e.logprob < 0 and len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token


def test_echo_scores_the_prompt(client, server):
    prompt = "Water boils at one hundred degrees"
    n_prompt = len(server.service.model.tokenize(prompt, True, False))
    done = client.completions.create(model="base", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2,
                                     extra_body={"ignore_eos": True})
    c = done.choices[0]
    assert c.text.startswith(prompt) and len(c.text) > len(prompt)
    lp = c.logprobs
    assert len(lp.tokens) == n_prompt + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens[:n_prompt]).endswith(prompt)       # BOS, if any, then the prompt's text
    for i in range(1, n_prompt):
        if lp.tokens[i] in lp.top_logprobs[i]:
            assert lp.top_logprobs[i][lp.tokens[i]] == pytest.approx(lp.token_logprobs[i])
        else:
            assert lp.token_logprobs[i] <= min(lp.top_logprobs[i].values())
    streamed = [ch.choices[0] for ch in client.completions.create(
        model="base", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2, stream=True,
        extra_body={"ignore_eos": True}) if ch.choices]
    assert "".join(ch.text for ch in streamed) == c.text
    got = [x for ch in streamed if ch.logprobs for x in ch.logprobs.token_logprobs]
    assert got[0] is None and got[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-9)
    plain = client.completions.create(model="base", prompt=prompt, max_tokens=2, echo=True)
    assert plain.choices[0].text.startswith(prompt)


def test_a_batch_of_prompts_answers_each_as_it_would_alone(client, http, server):
    """OpenAI's prompt array: choice k*n + j is prompt k's choice j, as a request of prompt k alone
    would answer it (the same seeds), more prompts than slots included; usage counts each prompt once."""
    prompts = ["Water boils at", "The capital of France is", "One, two,", "Roses are red,", "The sun rises in the"]
    assert len(prompts) > server.service.engine.n_seq
    alone = [client.completions.create(model="base", prompt=p, max_tokens=6, temperature=0, logprobs=1,
                                       extra_body={"ignore_eos": True}) for p in prompts]
    batch = client.completions.create(model="base", prompt=prompts, max_tokens=6, temperature=0, logprobs=1,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == list(range(len(prompts)))
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    for c, a in zip(batch.choices, alone, strict=True):
        assert c.logprobs.token_logprobs == pytest.approx(a.choices[0].logprobs.token_logprobs, abs=1e-9)
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 6 * len(prompts)
    ids = [server.service.model.tokenize(p, True, False) for p in prompts[:2]]
    sampled = client.completions.create(model="base", prompt=ids, n=2, max_tokens=5, temperature=1.0, seed=7)
    for k, p in enumerate(ids):
        one = client.completions.create(model="base", prompt=p, n=2, max_tokens=5, temperature=1.0, seed=7)
        assert [c.text for c in sampled.choices[2 * k:2 * k + 2]] == [c.text for c in one.choices]
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model="base", prompt=prompts, max_tokens=6, temperature=0, echo=True,
                                           stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {k: p + a.choices[0].text for k, (p, a) in enumerate(zip(prompts, alone, strict=True))}
    for body, param in (({"prompt": ["a", ""]}, "prompt[1]"), ({"prompt": ["a"] * 5, "n": 2}, "prompt"),
                        ({"prompt": [[1], []]}, "prompt")):
        r = http.post("/v1/completions", json={"max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_bad_logprob_requests_are_400s(http):
    for route, body, param in (
            ("/v1/chat/completions", {"messages": ASK, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
            ("/v1/chat/completions", {"messages": ASK, "top_logprobs": 2}, "top_logprobs"),
            ("/v1/completions", {"prompt": "a", "logprobs": 21}, "logprobs"),
            ("/v1/completions", {"prompt": "a", "logprobs": -1}, "logprobs")):
        r = http.post(route, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# -- logit_bias and seed --------------------------------------------------------------------
def test_logit_bias_bans_and_shifts_the_reported_distribution(client, http):
    ask = dict(model="base", prompt="The three primary colours are", max_tokens=1, temperature=0, logprobs=5)
    first = client.completions.create(**ask).choices[0]
    top_text = first.logprobs.tokens[0]
    top_id = http.post("/tokenize", json={"content": top_text}).json()["tokens"]
    assert len(top_id) == 1
    banned = client.completions.create(**ask, logit_bias={str(top_id[0]): -100}).choices[0]
    assert banned.text != top_text and top_text not in banned.logprobs.top_logprobs[0]
    # llama-server's list form, false meaning a ban, does the same
    listed = client.completions.create(**ask, extra_body={"logit_bias": [[top_id[0], False]]}).choices[0]
    assert listed.text == banned.text
    # a positive bias raises the token's reported logprob: the distribution is after the bias
    second = sorted(first.logprobs.top_logprobs[0].items(), key=lambda kv: -kv[1])[1]
    second_id = http.post("/tokenize", json={"content": second[0]}).json()["tokens"][0]
    lifted = client.completions.create(**ask, logit_bias={str(second_id): 3.0}).choices[0]
    assert lifted.logprobs.top_logprobs[0][second[0]] > second[1]
    for bias, param in (({"x1": 1}, "logit_bias"), ({"1": 101}, "logit_bias.1"), ({"99999999": 1}, "logit_bias"),
                        ([[1, True]], "logit_bias"), ([[-1, 1.0]], "logit_bias"), ([[1, 2, 3]], "logit_bias")):
        r = http.post("/v1/completions", json={"prompt": "a", "logit_bias": bias})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# -- n > 1 ---------------------------------------------------------------------------------
def metric(http, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", http.get("/metrics").text, re.M)
    assert m, name
    return float(m.group(1))


def evaluated(http) -> float:
    """Prompt tokens the engine decoded (admitted minus reused from a cache)."""
    return metric(http, "dreamstage_prompt_tokens_total") - metric(http, "dreamstage_prompt_tokens_cached_total")


def test_n_choices_share_one_prompt_evaluation_and_reproduce_per_seed(client, http):
    ask = dict(model="base", prompt="My favourite animal is the", max_tokens=10, temperature=1.0, seed=11,
               extra_body={"cache_prompt": False, "ignore_eos": True})
    before = evaluated(http)
    three = client.completions.create(n=3, **ask)
    spent = evaluated(http) - before
    assert sorted(c.index for c in three.choices) == [0, 1, 2]
    assert spent == three.usage.prompt_tokens                  # the prompt was decoded once, not three times
    assert three.usage.completion_tokens == 30
    again = client.completions.create(n=3, **ask)
    assert [c.text for c in again.choices] == [c.text for c in three.choices]
    # choice i is what a single request with seed + i draws
    alone = [client.completions.create(**{**ask, "seed": 11 + i}).choices[0].text for i in range(3)]
    assert alone == [c.text for c in three.choices]
    assert len({c.text for c in three.choices}) == 3


def test_n_choices_stream_by_index(client):
    ask = dict(model="base", messages=ASK, max_tokens=8, temperature=1.0, seed=5, n=2, logprobs=True)
    whole = client.chat.completions.create(**ask)
    texts, finishes, logprobs = ["", ""], [None, None], [[], []]
    for chunk in client.chat.completions.create(**ask, stream=True):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            finishes[ch.index] = ch.finish_reason or finishes[ch.index]
            if ch.logprobs:
                logprobs[ch.index] += [e.logprob for e in ch.logprobs.content]
    assert texts == [c.message.content for c in sorted(whole.choices, key=lambda c: c.index)]
    assert finishes == [c.finish_reason for c in sorted(whole.choices, key=lambda c: c.index)]
    assert logprobs == [[e.logprob for e in c.logprobs.content] for c in sorted(whole.choices, key=lambda c: c.index)]


def test_more_choices_than_slots_is_a_400(http, server):
    r = http.post("/v1/chat/completions", json={"messages": ASK, "n": server.service.engine.n_seq + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_explicit_nulls_take_the_defaults(client, http):
    body = {"prompt": "Hi", "max_tokens": 2, "logit_bias": None, "temperature": None, "seed": None, "logprobs": None,
            "stop_token_ids": None, "n_predict": None, "repeat_last_n": None}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200 and "x-dreamstage-ignored-fields" not in r.headers, r.text
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, "logit_bias": None,
                                                "top_logprobs": None, "chat_template_kwargs": None})
    assert r.status_code == 200, r.text


# -- tools ----------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "The sum of two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
WEATHER_ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def weather_args_valid(arguments: str) -> dict:
    """The call's arguments, valid for get_weather's parameter schema (nothing more than it names)."""
    args = json.loads(arguments)
    jsonschema_rs.validate({**WEATHER["function"]["parameters"], "additionalProperties": False}, args)
    return args


def test_a_tool_loop_call_result_answer(client):
    first = client.chat.completions.create(model="base", messages=WEATHER_ASK, tools=[WEATHER], tool_choice="required",
                                           temperature=0, max_tokens=64)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    weather_args_valid(call.function.arguments)
    messages = [*WEATHER_ASK, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear", "temperature_c": 21}'}]
    final = client.chat.completions.create(model="base", messages=messages, tools=[WEATHER], temperature=0,
                                           max_tokens=24)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the call and its result are in the prompt
    assert final.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens + 10
    answer = client.chat.completions.create(model="base", messages=messages, tools=[WEATHER], tool_choice="none",
                                            temperature=0, max_tokens=24)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_a_streamed_tool_call_matches_the_whole_one(client):
    ask = dict(model="base", messages=WEATHER_ASK, tools=[WEATHER, ADD], tool_choice="required", temperature=0,
               max_tokens=64)
    whole = client.chat.completions.create(**ask).choices[0].message.tool_calls
    name, arguments, finish, ids = "", "", None, set()
    for chunk in client.chat.completions.create(**ask, stream=True):
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                ids.add(tc.id)
                name += tc.function.name or ""
                arguments += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and len(ids) == 1
    assert (name, json.loads(arguments)) == (whole[0].function.name, json.loads(whole[0].function.arguments))


def test_a_streamed_tool_loop_accumulates_in_the_sdk(client):
    """The openai SDK's own stream accumulation (index, id, type, name, arguments) builds the call,
    the schema validates it, and the loop goes on streamed to a final answer."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(model="base", messages=WEATHER_ASK, tools=[WEATHER, ADD],
                                                tool_choice="required", temperature=0, max_tokens=64, stream=True):
        state.handle_chunk(chunk)
    first = state.get_final_completion().choices[0]
    assert first.finish_reason == "tool_calls" and len(first.message.tool_calls) == 1
    call = first.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    weather_args_valid(call.function.arguments)
    sent = {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": call.function.arguments}}
    messages = [*WEATHER_ASK, {"role": "assistant", "content": None, "tool_calls": [sent]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear", "temperature_c": 21}'}]
    with client.chat.completions.stream(model="base", messages=messages, tools=[WEATHER, ADD], tool_choice="none",
                                        temperature=0, max_tokens=16) as stream:
        said = "".join(ev.delta for ev in stream if ev.type == "content.delta")
        final = stream.current_completion_snapshot.choices[0]   # get_final_completion refuses "length"
    assert said and final.message.content == said and final.finish_reason in ("stop", "length")
    assert not final.message.tool_calls


MALFORMED_CALLS = ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',   # cut JSON
                   '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',               # not an offered tool
                   '[TOOL_CALLS] [{"name": "add", "arguments": [1, 2]}]')                    # arguments not an object


@pytest.mark.parametrize("text", MALFORMED_CALLS)
def test_a_malformed_call_is_answered_as_text(client, text):
    """The model's answer held to a malformed call by a grammar: 200 with the text, never a 500."""
    gbnf = "root ::= " + json.dumps(text)
    ask = dict(model="base", messages=WEATHER_ASK, tools=[WEATHER, ADD], temperature=0, max_tokens=64,
               extra_body={"grammar": gbnf})
    done = client.chat.completions.create(**ask).choices[0]
    assert (done.message.content, done.message.tool_calls, done.finish_reason) == (text, None, "stop")
    chunks = [ch for chunk in client.chat.completions.create(**ask, stream=True) for ch in chunk.choices]
    assert "".join(ch.delta.content or "" for ch in chunks) == text
    assert not any(ch.delta.tool_calls for ch in chunks) and chunks[-1].finish_reason == "stop"


def test_a_text_answer_with_tools_offered_streams_as_it_comes(client):
    text = "The sky over Paris is clear, and it is 21 degrees."
    chunks = [ch for chunk in client.chat.completions.create(
        model="base", messages=WEATHER_ASK, tools=[WEATHER], temperature=0, max_tokens=64, stream=True,
        extra_body={"grammar": "root ::= " + json.dumps(text)}) for ch in chunk.choices]
    pieces = [ch.delta.content for ch in chunks if ch.delta.content]
    assert "".join(pieces) == text and len(pieces) > 5 and chunks[-1].finish_reason == "stop"


def test_a_named_tool_choice_calls_that_tool(client):
    done = client.chat.completions.create(
        model="base", messages=[{"role": "user", "content": "What is two plus three?"}], tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "add"}}, temperature=0, max_tokens=48)
    call = done.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "add" and set(args) == {"a", "b"} and all(type(v) is int for v in args.values())


def test_bad_tool_requests_are_400s(http):
    for body, param in (({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                         "tool_choice"),
                        ({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
                         "tools[0].function.name"),
                        ({"tools": [WEATHER], "tool_choice": "required", "grammar": 'root ::= "a"'}, "body")):
        r = http.post("/v1/chat/completions", json={"messages": ASK, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# -- vLLM's structured outputs -------------------------------------------------------------------
GUIDED_REGEXES = (r"\d{3}-\d{4}", r"^(yes|no|maybe)$", r"[A-Z][a-z]{1,6}, [a-z]{2,5}!", r"(?:ab){1,3}c",
                  r"[^\d\s]{2,4}\.", r"[\w.-]{1,8}@[a-z]{1,6}\.(com|org)")


def test_vllm_guided_fields_hold_the_sampled_answer_to_the_constraint(client):
    """guided_regex / guided_choice / guided_json and structured_outputs, sampled at temperature 1: each
    answer a full match of the regex (Python's re), one of the choices, or valid against the schema."""
    ask = dict(model="base", messages=ASK, temperature=1.0, max_tokens=40)
    for i, pattern in enumerate(GUIDED_REGEXES):
        for key, body in (("guided_regex", {"guided_regex": pattern}),
                          ("structured_outputs", {"structured_outputs": {"regex": pattern}})):
            done = client.chat.completions.create(**ask, seed=i, extra_body=body).choices[0]
            assert done.finish_reason == "stop" and re.fullmatch(pattern, done.message.content), (key, done)
    choices = ["x y", 'say "hi"', "a\\b\nc", "Paris"]
    for seed in range(4):
        got = client.completions.create(model="base", prompt="The capital of France is", temperature=1.0,
                                        max_tokens=16, seed=seed, extra_body={"guided_choice": choices}).choices[0]
        assert got.text in choices and got.finish_reason == "stop", got
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "rank"], "additionalProperties": False}
    for body in ({"guided_json": schema}, {"guided_json": json.dumps(schema)},
                 {"structured_outputs": {"json": schema}}):
        done = client.chat.completions.create(**{**ask, "max_tokens": 64}, seed=5, extra_body=body).choices[0]
        assert done.finish_reason == "stop" and jsonschema_rs.is_valid(schema, json.loads(done.message.content))
    anything = client.chat.completions.create(**{**ask, "max_tokens": 64}, seed=6,
                                              extra_body={"structured_outputs": {"json_object": True}}).choices[0]
    if anything.finish_reason == "stop":
        json.loads(anything.message.content)


@pytest.mark.parametrize(("body", "param", "says"), (
    ({"guided_regex": "(?=a)b"}, "guided_regex", "lookaround"),
    ({"guided_regex": r"(a)\1"}, "guided_regex", "backreference"),
    ({"guided_regex": "a^b"}, "guided_regex", "anchor"),
    ({"guided_regex": "(?i)abc"}, "guided_regex", "case-insensitive"),
    ({"guided_regex": "["}, "guided_regex", "not a regular expression"),
    ({"guided_regex": "(" * 3000 + "a" + ")" * 3000}, "guided_regex", "nest too deeply"),
    ({"structured_outputs": {"regex": "a)"}}, "structured_outputs.regex", "not a regular expression"),
    ({"guided_json": "{not json"}, "guided_json", "not JSON"),
    ({"guided_choice": ["a", ""]}, "guided_choice", "no empty one"),
    ({"guided_choice": []}, "guided_choice", None),
    ({"guided_choice": ["a"], "grammar": 'root ::= "a"'}, "body", "guided_choice"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "body", "response_format"),
    ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "body", "structured_outputs.regex"),
))
def test_a_constraint_a_grammar_cannot_hold_is_a_400_naming_it(http, body, param, says):
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert says is None or says in r.json()["error"]["message"], r.text


# -- /v1/embeddings -----------------------------------------------------------------------------
def reference_embedding(model, tokens: list[int]) -> np.ndarray:
    lc = model.lc
    lc.llama_memory_seq_rm(model.memory, 0, -1, -1)
    batch = lc.llama_batch_init(len(tokens), 0, 1)
    lc.llama_set_embeddings(model.ctx, True)
    try:
        batch.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, i, 1, 1
            batch.seq_id[i][0] = 0
        assert lc.llama_decode(model.ctx, batch) == 0
        rows = [np.ctypeslib.as_array(lc.llama_get_embeddings_ith(model.ctx, i), shape=(model.n_embd,)).copy()
                for i in range(len(tokens))]
    finally:
        lc.llama_set_embeddings(model.ctx, False)
        lc.llama_batch_free(batch)
    mean = np.mean(np.array(rows, dtype=np.float64), axis=0)
    return mean / np.linalg.norm(mean)


def test_embeddings_are_off_unless_asked(http):
    r = http.post("/v1/embeddings", json={"input": "hello"})
    assert r.status_code == 501 and "--embeddings" in r.json()["error"]["message"]


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_the_output_buffer_is_reserved_once_and_serving_is_unchanged(reference):
    before = reference.generate_greedy("The capital of France is", 6)
    rss = rss_bytes()
    reserved = reference.reserve_outputs()
    assert reserved == reference.n_batch * (reference.n_vocab + reference.n_embd) * 4
    assert rss_bytes() - rss > 0.9 * reserved        # taken (and written) now, not at the first embedding
    assert reference.lc.llama_memory_seq_pos_max(reference.memory, 0) == -1     # the batch left no cells
    assert reference.generate_greedy("The capital of France is", 6) == before


def test_embeddings_match_the_models_pooled_hidden_states(reference):
    with BackgroundServer(ServerSettings(ctx=1024, parallel=2, threads=1, embeddings=True)) as srv:
        model = srv.service.model
        assert srv.service.output_reserve_bytes == model.output_rows_bytes(model.n_batch)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        before = client.chat.completions.create(model="base", messages=ASK, max_tokens=8, temperature=0)
        texts = ["The cat sat on the mat.", "Quantum chromodynamics", "The cat sat on the mat."]
        got = client.embeddings.create(model="base", input=texts)
        assert [d.index for d in got.data] == [0, 1, 2]
        vecs = [np.array(d.embedding) for d in got.data]
        assert all(v.shape == (reference.n_embd,) and abs(np.linalg.norm(v) - 1) < 1e-6 for v in vecs)
        assert np.array_equal(vecs[0], vecs[2]) and not np.allclose(vecs[0], vecs[1])
        tokens = reference.tokenize(texts[1], True, False)
        assert got.usage.prompt_tokens == 2 * len(reference.tokenize(texts[0], True, False)) + len(tokens)
        assert np.allclose(vecs[1], reference_embedding(reference, tokens), atol=1e-4)
        ids = client.embeddings.create(model="base", input=tokens).data[0].embedding
        assert np.allclose(ids, vecs[1], atol=1e-6)
        # serving is unchanged after it: the same greedy answer
        after = client.chat.completions.create(model="base", messages=ASK, max_tokens=8, temperature=0)
        assert after.choices[0].message.content == before.choices[0].message.content
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            plain = http.post("/v1/embeddings", json={"input": texts[1], "encoding_format": "float"}).json()
            assert np.allclose(plain["data"][0]["embedding"], vecs[1], atol=1e-6)
            for body, param in (({"input": ""}, "input[0]"), ({"input": [[1, 10**9]]}, "input[0]"),
                                ({"input": [1] * 2000}, "input")):
                r = http.post("/v1/embeddings", json=body)
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
