"""Many named adapters on one resident model (issue 46): selection per request,
import and export, scoped keys, --max-adapters, unloading, fair training queues.

Adapters here are hand-made GGUF LoRAs with random factors on the tiny llama
model (tests/tiny_model.py), imported over HTTP: each changes the model's
greedy answers, and nothing trains, so the file stays fast.
"""
from __future__ import annotations

import base64
import io
import json
import threading
import zipfile

import httpx
import numpy as np
import pytest
from background_server import BackgroundServer

from dreamstage.adapters.files import load_lora, save_lora
from dreamstage.server.settings import ServerSettings

PROMPT = "The capital of the moon is"
KEY = "operator-key"
ALICE_KEY, BOB_KEY, READER_KEY = "alice-key", "bob-key", "reader-key"


def lora_file(path, seed: int, targets=("attn_q", "attn_v"), n_layer: int = 2, rank: int = 4, arch: str = "llama",
              n_embd: int = 64, kv_out: int = 32, scale: float = 1.5):
    """A GGUF LoRA for the tiny model with random A and B (B is not zero: it changes the answers)."""
    rng = np.random.default_rng(seed)
    outs = {"attn_q": n_embd, "attn_k": kv_out, "attn_v": kv_out, "attn_output": n_embd}
    factors = {(layer, t): (rng.normal(0, 1 / np.sqrt(n_embd), (rank, n_embd)).astype(np.float32),
                            rng.normal(0, scale, (outs[t], rank)).astype(np.float32))
               for layer in range(n_layer) for t in targets}
    return save_lora(path, factors, alpha=float(rank), model_arch=arch)


def b64(path) -> str:
    return base64.b64encode(open(path, "rb").read()).decode()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("loras")
    return {name: lora_file(d / f"{name}.gguf", seed) for name, seed in (("alice", 1), ("bob", 2), ("alice2", 3),
                                                                         ("carol", 4))}


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps({ALICE_KEY: {"adapters": ["alice"], "train": True},
                                BOB_KEY: {"adapters": ["bob"], "train": True},
                                READER_KEY: {"adapters": ["alice"], "train": False}}))
    return path


def settings(tiny_model_path, state_dir, **kw) -> ServerSettings:
    base = dict(model=str(tiny_model_path), ctx=1024, parallel=4, threads=1, kv_type="f32", state_dir=str(state_dir))
    return ServerSettings(**{**base, **kw})


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory, files, key_file):
    state = tmp_path_factory.mktemp("state")
    with BackgroundServer(settings(tiny_model_path, state, api_key=KEY, api_keys=str(key_file),
                                   max_adapters=3)) as srv:
        with httpx.Client(base_url=srv.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as http:
            for name in ("alice", "bob"):
                r = http.post("/adapters", json={"name": name, "gguf": b64(files[name])})
                assert r.status_code == 201, r.text
            yield srv, http


def complete(http, model=None, prompt=PROMPT, key=None, **kw):
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, **kw}
    if model is not None:
        body["model"] = model
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return http.post("/v1/completions", json=body, headers=headers)


def text(r) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_each_adapter_answers_as_it_does_alone_and_the_base_differs(server, tiny_model_path, tmp_path, files):
    srv, http = server
    alice, bob, base = text(complete(http, "alice")), text(complete(http, "bob")), text(complete(http, "base"))
    assert len({alice, bob, base}) == 3
    # the same, asked together from threads (requests of both adapters in flight at once)
    got: dict[str, str] = {}

    def ask(name):
        got[name] = text(complete(http, name))
    threads = [threading.Thread(target=ask, args=(n,)) for n in ("alice", "bob", "base", "alice")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {"alice": alice, "bob": bob, "base": base}
    # each equals that adapter served alone: a fresh server with only it, as the default
    with BackgroundServer(settings(tiny_model_path, tmp_path / "alone", adapter=str(files["alice"]))) as alone:
        with httpx.Client(base_url=alone.url, timeout=60) as h2:
            assert text(complete(h2)) == alice
            assert text(complete(h2, "base")) == base


def test_responses_name_the_adapter_and_version_that_answered(server):
    srv, http = server
    r = complete(http, "alice")
    assert r.headers["x-dreamstage-adapter"] == "alice@1"
    assert r.json()["adapter"] == "alice@1" and r.json()["model"] == "alice"
    assert int(r.headers["x-dreamstage-adapter-version"]) == r.json()["adapter_version"] >= 1
    r = complete(http, srv.service.model_id)
    assert r.headers["x-dreamstage-adapter"] == "base" and r.json()["adapter_version"] == 0
    # /slots (and the dashboard) show which adapter each slot's cached prefix belongs to
    cached = {sl["cached_adapter"] for sl in http.get("/slots").json()["slots"]}
    assert {"alice@1", "base"} <= cached
    names = {n["name"]: n for n in http.get("/adapters").json()["names"]}
    assert names["alice"]["served"]["version"] >= 1 and names["bob"]["versions"] == [1]
    r = http.post("/v1/chat/completions", json={"model": "bob", "max_tokens": 4, "temperature": 0,
                                                "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["adapter"] == "bob@1" and r.json()["model"] == "bob"


def test_unknown_model_is_openai_model_not_found_never_the_default(server):
    srv, http = server
    for model in ("nobody", "alice@99", "gpt-4o"):
        r = complete(http, model)
        assert r.status_code == 404
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model" and model in err["message"]
        assert err["type"] == "invalid_request_error"


def test_a_pinned_version_answers_while_a_newer_one_serves(server, files):
    srv, http = server
    v1 = text(complete(http, "alice"))
    r = http.post("/adapters", json={"name": "alice", "gguf": b64(files["alice2"])})
    assert r.status_code == 201 and r.json()["imported"]["version"] == 2
    try:
        v2 = text(complete(http, "alice"))
        assert v2 != v1
        assert text(complete(http, "alice@1")) == v1 and text(complete(http, "alice@2")) == v2
        pinned = complete(http, "alice@1")
        assert pinned.headers["x-dreamstage-adapter"] == "alice@1" and pinned.json()["adapter_version"] is None
    finally:
        assert http.post("/adapters/alice/rollback").status_code == 200
    assert text(complete(http, "alice")) == v1


def test_llama_server_lora_field_selects_an_adapter(server):
    srv, http = server
    alice, base = text(complete(http, "alice")), text(complete(http, "base"))
    models = [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert text(complete(http, lora=[{"name": "alice", "scale": 1.0}])) == alice
    assert text(complete(http, lora=[{"id": models.index("alice") - 1, "scale": 1.0}])) == alice
    assert text(complete(http, lora=[{"name": "alice", "scale": 0.0}])) == base
    half = complete(http, lora=[{"name": "alice", "scale": 0.5}])
    assert half.json()["adapter"] == "alice@1*0.5"
    r = complete(http, lora=[{"name": "alice", "scale": 1.0}, {"name": "bob", "scale": 1.0}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora"
    r = complete(http, lora=[{"id": 7}])
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = complete(http, "bob", lora=[{"name": "alice"}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora"
    r = complete(http, lora=[{"scale": 1.0}])
    assert r.status_code == 400


def test_v1_models_lists_the_base_and_every_served_adapter(server):
    srv, http = server
    data = http.get("/v1/models").json()["data"]
    assert data[0]["id"] == srv.service.model_id and data[0]["owned_by"] == "dreamstage"
    adapters = {m["id"]: m for m in data[1:]}
    assert set(adapters) == {"alice", "bob"}
    for m in adapters.values():
        assert m["object"] == "model" and m["parent"] == srv.service.model_id and m["version"] == 1
        assert m["created"] > 0 and m["adapter_version"] >= 1
    # OpenAI's retrieve: one entry by its id ("base" for the base), 404 otherwise
    assert http.get("/v1/models/alice").json() == adapters["alice"]
    assert http.get("/v1/models/base").json() == data[0] == http.get(f"/v1/models/{data[0]['id']}").json()
    r = http.get("/v1/models/nobody")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_scoped_keys_keep_tenants_apart(server, files):
    srv, http = server
    alice_answer = text(complete(http, "alice"))
    assert text(complete(http, "alice", key=ALICE_KEY)) == alice_answer
    for key, other in ((ALICE_KEY, "bob"), (BOB_KEY, "alice")):
        h = {"Authorization": f"Bearer {key}"}
        assert complete(http, other, key=key).json()["error"]["code"] == "model_not_found"
        assert complete(http, lora=[{"name": other}], key=key).status_code == 404
        assert [m["id"] for m in http.get("/v1/models", headers=h).json()["data"][1:]] == [key.split("-")[0]]
        assert http.get(f"/v1/models/{other}", headers=h).status_code == 404
        listed = http.get("/adapters", headers=h).json()
        assert {a["name"] for a in listed["adapters"]} == {key.split("-")[0]}
        assert http.get(f"/adapters/{other}/versions/1", headers=h).status_code == 404
        assert http.get(f"/adapters/{other}/versions/1?format=peft", headers=h).status_code == 404
        assert http.delete(f"/adapters/{other}", headers=h).status_code == 404
        assert http.post(f"/adapters/{other}/promote", headers=h).status_code == 404
        assert http.post(f"/adapters/{other}/rollback", headers=h).status_code == 404
        assert http.post("/adapters/rollback", headers=h).status_code == 404
        r = http.post("/train", json={"text": "a lesson", "adapter": other}, headers=h)
        assert r.status_code == 404 and r.json()["error"]["param"] == "adapter"
        assert http.post("/adapters", json={"name": other, "gguf": b64(files["carol"])}, headers=h).status_code == 404
        assert http.get("/slots", headers=h).status_code == 404          # names every adapter
    # own adapter: exported; a key without train may chat but not train
    assert http.get("/adapters/alice/versions/1", headers={"Authorization": f"Bearer {ALICE_KEY}"}).status_code == 200
    assert text(complete(http, "alice", key=READER_KEY)) == alice_answer
    r = http.post("/train", json={"text": "a lesson", "adapter": "alice"},
                  headers={"Authorization": f"Bearer {READER_KEY}"})
    assert r.status_code == 403
    assert complete(http, "alice", key="wrong").status_code == 401


def test_malformed_and_mismatched_imports_are_422_and_store_nothing(server, tmp_path):
    srv, http = server
    before = http.get("/adapters").json()["adapters"]
    wrong_dims = lora_file(tmp_path / "dims.gguf", 5, n_embd=96, kv_out=48)
    wrong_arch = lora_file(tmp_path / "arch.gguf", 5, arch="qwen2")
    bad_layer = lora_file(tmp_path / "layer.gguf", 5, n_layer=4)
    cases = [({"name": "dave", "gguf": base64.b64encode(b"not a gguf at all").decode()}, "gguf"),
             ({"name": "dave", "gguf": "***"}, "gguf"),
             ({"name": "dave", "gguf": b64(wrong_arch)}, "gguf"),
             ({"name": "dave", "gguf": b64(wrong_dims)}, "name"),
             ({"name": "dave", "gguf": b64(bad_layer)}, "name"),
             ({"name": "dave"}, "body"),
             ({"name": "../x", "gguf": b64(wrong_dims)}, "name"),
             ({"name": "base", "gguf": b64(wrong_dims)}, "name"),
             ({"name": "dave", "peft": {"config": {"r": 4, "lora_alpha": 8}, "safetensors": "AAAA"}}, "peft"),
             ({"name": "dave", "peft": {"config": {"peft_type": "IA3"}, "safetensors": "AAAA"}}, "peft")]
    for body, param in cases:
        r = http.post("/adapters", json=body)
        assert r.status_code == 422, (body.get("name"), param, r.text)
        assert r.json()["error"]["param"] == param, r.text
    assert http.get("/adapters").json()["adapters"] == before
    assert not list(srv.service.store.adapters_dir.glob(".import.*"))


def test_round_trip_import_serve_export_gguf_and_peft(server, files, tmp_path):
    srv, http = server
    r = http.get("/adapters/bob/versions/1")
    assert r.status_code == 200 and r.content == open(files["bob"], "rb").read()
    r = http.get("/adapters/bob/versions/1?format=peft")
    assert r.status_code == 200
    z = zipfile.ZipFile(io.BytesIO(r.content))
    config = json.loads(z.read("adapter_config.json"))
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    peft = {"config": config, "safetensors": base64.b64encode(z.read("adapter_model.safetensors")).decode()}
    r = http.post("/adapters", json={"name": "bobpeft", "peft": peft})
    assert r.status_code == 201, r.text
    try:
        # the PEFT file converted back is the same adapter: the same factors, the same logprobs
        back, alpha = load_lora(srv.service.store.adapter_path("bobpeft", 1))
        orig, alpha0 = load_lora(files["bob"])
        assert alpha == alpha0 and back.keys() == orig.keys()
        for k in orig:
            np.testing.assert_array_equal(back[k][0], orig[k][0])
            np.testing.assert_array_equal(back[k][1], orig[k][1])
        a = complete(http, "bob", logprobs=5, cache_prompt=False).json()["choices"][0]["logprobs"]
        b = complete(http, "bobpeft", logprobs=5, cache_prompt=False).json()["choices"][0]["logprobs"]
        assert a["tokens"] == b["tokens"] and a["token_logprobs"] == b["token_logprobs"]
    finally:
        assert http.delete("/adapters/bobpeft").status_code == 200


def test_max_adapters_refuses_one_more_and_unloading_makes_room(server, files):
    srv, http = server
    r = http.post("/adapters", json={"name": "carol", "gguf": b64(files["carol"])})
    assert r.status_code == 201                            # the third of --max-adapters 3
    r = http.post("/adapters", json={"name": "dave", "gguf": b64(files["carol"])})
    assert r.status_code == 409 and r.json()["error"]["code"] == "max_adapters"
    assert "max-adapters 3" in r.json()["error"]["message"]
    assert "dave" not in {a["name"] for a in http.get("/adapters").json()["adapters"]}
    r = http.delete("/adapters/carol")
    assert r.status_code == 200 and r.json()["unloaded"]
    r = complete(http, "carol")
    assert r.status_code == 404 and "no served version" in r.json()["error"]["message"]
    assert text(complete(http, "carol@1"))              # its versions stay stored, pinnable


def test_the_memory_allowance_refuses_an_adapter_that_does_not_fit(tiny_model_path, tmp_path, files):
    with BackgroundServer(settings(tiny_model_path, tmp_path / "s", adapter_budget_mib=0.001)) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            r = http.post("/adapters", json={"name": "alice", "gguf": b64(files["alice"])})
            assert r.status_code == 409 and r.json()["error"]["code"] == "adapter_memory"
            assert "allowance" in r.json()["error"]["message"]
            assert http.get("/adapters").json()["adapters"] == []
            r = http.post("/adapters", json={"name": "alice", "gguf": b64(files["alice"]), "promote": False})
            assert r.status_code == 201                   # stored, not resident: nothing counted


def test_one_batch_decodes_the_base_and_two_adapters_each_as_it_answers_alone(tiny_model_path, tmp_path, files):
    """The engine seats requests of different adapters side by side and decodes them in ONE
    batch (the adapter bank); an adapter wider than the bank's rank takes batches of its own.
    Every answer equals its adapter's answer alone."""
    from dreamstage.adapters.choice import BASE, AdapterChoice
    from dreamstage.serving.engine import Engine, Finished, GenerationRequest
    from dreamstage.serving.resident import ResidentConfig, ResidentModel
    from dreamstage.serving.sampling import SamplingParams

    model = ResidentModel(ResidentConfig(model_path=str(tiny_model_path), n_ctx=512, n_seq=4, n_threads=1,
                                         kv_type="f32", kv_unified=False))
    engine = Engine(model, adapter_max_rank=8)
    bound: list[set] = []                   # each decode batch's adapters, as the engine bound them
    bind = engine.adapters.bind
    engine.adapters.bind = lambda rows: (bound.append({r.key for r in rows}), bind(rows))[1]
    engine.start()
    try:
        wide = AdapterChoice("wide", 1, str(lora_file(tmp_path / "wide.gguf", 9, rank=16)))
        choices = [AdapterChoice("alice", 1, str(files["alice"])), AdapterChoice("bob", 1, str(files["bob"])),
                   BASE, wide]

        def run(batch) -> dict[str, list[int]]:
            """Greedy tokens of each choice, all submitted at once."""
            tokens: dict[str, list[int]] = {c.label: [] for c in batch}
            finished = threading.Semaphore(0)

            def sink(ev, label):
                if isinstance(ev, Finished):
                    finished.release()
                elif hasattr(ev, "token"):
                    tokens[label].append(ev.token)
            for c in batch:
                engine.submit(GenerationRequest(PROMPT, 16, SamplingParams(temperature=0.0), ignore_eos=True,
                                                adapter=c), lambda ev, label=c.label: sink(ev, label))
            for _ in batch:
                assert finished.acquire(timeout=60)
            return tokens
        together = run(choices)
        narrow = {c.key for c in choices[:3]}
        assert any(b == narrow for b in bound), "no batch decoded the base and both adapters together"
        assert engine.stats.mixed_batches >= 1
        assert all(b == {wide.key} for b in bound if wide.key in b), "the wide adapter shared a batch"
        assert {wide.key} in bound
        alone = {}
        for c in choices:
            alone.update(run([c]))
        assert together == alone
        assert len({tuple(v) for v in alone.values()}) == 4
    finally:
        engine.stop()
        engine.adapters.close()
        model.close()


def test_the_training_queue_takes_adapter_names_in_turn(tmp_path):
    from dreamstage.training.jobs.request import parse_train_request
    from dreamstage.training.jobs.store import JobStore

    with JobStore(tmp_path / "s") as store:
        ids = [store.submit(parse_train_request({"text": f"lesson {i}", "adapter": name}))["id"]
               for i, name in enumerate(["a", "a", "a", "b", "a", "c"])]
        a1, a2, a3, b1, a4, c1 = ids
        assert store.queue() == [a1, b1, c1, a2, a3, a4]
        store.transition(a1, "starting")
        assert store.queue() == [b1, c1, a2, a3, a4]      # a trained last: the others go first
        store.transition(a1, "cancelled")
        store.transition(b1, "starting")
        assert store.queue()[:2] == [c1, a2]


def test_adapter_and_out_name_one_adapter(tmp_path):
    from pydantic import ValidationError

    from dreamstage.training.jobs.request import parse_train_request

    assert parse_train_request({"text": "x", "adapter": "alice"}).to_job_spec().out == "alice"
    assert parse_train_request({"text": "x", "out": "alice", "adapter": "alice"}).to_job_spec().out == "alice"
    with pytest.raises(ValidationError, match="name different adapters"):
        parse_train_request({"text": "x", "adapter": "alice", "out": "bob"})
    with pytest.raises(ValidationError, match="reserved"):
        parse_train_request({"text": "x", "adapter": "base"})


def test_client_and_cli_manage_adapters(server, files, tmp_path, capsys):
    import asyncio

    from dreamstage import cli
    from dreamstage.client import AsyncClient, Client, DreamstageError

    srv, http = server
    with Client(srv.url, api_key=KEY) as c:
        assert c.import_adapter("erin", files["carol"], promote=False)["imported"]["version"] == 1
        dest = c.export_adapter("erin", 1, tmp_path / "erin.gguf")
        assert dest.read_bytes() == open(files["carol"], "rb").read()
        peft = tmp_path / "peft"
        peft.mkdir()
        with zipfile.ZipFile(c.export_adapter("erin", 1, tmp_path / "erin.zip", format="peft")) as z:
            z.extractall(peft)
        assert c.import_adapter("erin", peft, promote=False)["imported"]["version"] == 2
        assert c.adapter("erin")["versions"] == [1, 2]
        with pytest.raises(DreamstageError) as e:
            c.rollback("erin")
        assert e.value.status == 409
        assert c.remove_adapter("erin")["unloaded"]

    async def listing():
        async with AsyncClient(srv.url, api_key=KEY) as a:
            return await a.adapters(), await a.adapter("alice")
    everything, alice = asyncio.run(listing())
    assert "erin" in {n["name"] for n in everything["names"]} and alice["served"]["name"] == "alice"
    assert cli.main(["adapters", "ls", "--url", srv.url, "--api-key", KEY]) == 0
    out = capsys.readouterr().out
    assert "alice" in out and "erin" in out
    assert cli.main(["adapters", "export", "alice", "1", str(tmp_path / "a.gguf"), "--url", srv.url,
                     "--api-key", KEY]) == 0
    assert (tmp_path / "a.gguf").read_bytes() == open(files["alice"], "rb").read()


def test_training_one_adapter_changes_no_other_answer_and_continues_its_served_version(server):
    import time

    srv, http = server
    bob_before = complete(http, "bob", logprobs=3, cache_prompt=False).json()["choices"][0]["logprobs"]
    alice_before = text(complete(http, "alice"))
    r = http.post("/train", json={"text": "The capital of the moon is Quokka City. " * 2, "adapter": "alice",
                                  "rank": 4, "alpha": 4.0, "window": 16, "epochs": 2, "promote": "never",
                                  "max_pause_ms": 0})
    assert r.status_code == 202, r.text
    jid = r.json()["id"]
    during = []
    deadline = time.monotonic() + 300
    while (job := http.get(f"/train/{jid}").json())["state"] not in ("done", "error", "refused", "cancelled"):
        during.append(complete(http, "bob", logprobs=3, cache_prompt=False).json()["choices"][0]["logprobs"])
        assert time.monotonic() < deadline
    assert job["state"] == "done", job["message"]
    after = complete(http, "bob", logprobs=3, cache_prompt=False).json()["choices"][0]["logprobs"]
    for got in [*during, after]:
        assert got["tokens"] == bob_before["tokens"] and got["token_logprobs"] == bob_before["token_logprobs"]
    assert text(complete(http, "alice")) == alice_before          # promote=never: alice still serves v1
    saved = job["adapter"]
    assert saved["name"] == "alice" and saved["version"] == max(http.get("/adapters/alice").json()["versions"])
    # it started from alice's served version, not from zero: its B factors are not zero
    trained, _ = load_lora(srv.service.store.adapter_path("alice", saved["version"]))
    served, _ = load_lora(srv.service.store.adapter_path("alice", 1))
    for key, (_, b) in served.items():
        assert np.abs(trained[key][1] - b).max() < np.abs(b).max()     # near the served factors, moved a little


def test_unloading_an_adapter_that_trains_or_serves_is_409(server):
    import time

    from dreamstage.adapters.choice import AdapterChoice

    srv, http = server
    r = http.post("/train", json={"text": "A long lesson about the moon. " * 4, "adapter": "bob", "rank": 4,
                                  "alpha": 4.0, "window": 16, "epochs": 1000, "promote": "never"})
    jid = r.json()["id"]
    try:
        deadline = time.monotonic() + 120
        while http.get(f"/train/{jid}").json()["state"] not in ("running", "done", "error"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = http.delete("/adapters/bob")
        assert r.status_code == 409 and r.json()["error"]["code"] == "adapter_in_use" and "training" in r.text
    finally:
        http.post(f"/train/{jid}/cancel")
    # a request holding the adapter in a slot: the engine refuses to free it
    adapters = srv.service.engine.adapters
    view = srv.service.store.served("bob")
    choice = AdapterChoice("bob", view["version"], view["path"])
    adapters.acquire(choice)              # as a slot does at admission (the engine is idle between requests)
    try:
        assert adapters.unload("bob") is False
    finally:
        adapters.release(choice)


def test_a_decode_after_lend_context_reads_no_bank_slot(tiny_model_path, files):
    """Serving's last batch leaves the bank armed; a drift probe's decode that follows
    lend_context() is the base model's, bit for bit (without it, it would read the slots)."""
    from dreamstage.adapters.choice import AdapterChoice
    from dreamstage.adapters.selection import MixedAdapters
    from dreamstage.serving.resident import ResidentConfig, ResidentModel

    model = ResidentModel(ResidentConfig(model_path=str(tiny_model_path), n_ctx=256, n_seq=2, n_threads=1,
                                         kv_type="f32", kv_unified=False))
    seam = MixedAdapters(model, 2)
    try:
        toks = model.tokenize(PROMPT)

        def probe() -> np.ndarray:
            model.lc.llama_memory_seq_rm(model.memory, 1, -1, -1)
            model.decode_entries([(t, i, 1, i == len(toks) - 1) for i, t in enumerate(toks)])
            return np.ctypeslib.as_array(model.lc.llama_get_logits_ith(model.ctx, len(toks) - 1),
                                         shape=(model.n_vocab,)).copy()
        base = probe()
        alice = AdapterChoice("alice", 1, str(files["alice"]))
        seam.acquire(alice)
        seam.bind([alice] * len(toks))
        armed = probe()                         # the bank still armed: every row on alice's slot
        assert not np.array_equal(armed, base)
        seam.bind([alice] * len(toks))
        seam.lend_context()
        assert np.array_equal(probe(), base)
    finally:
        seam.close()
        model.close()
