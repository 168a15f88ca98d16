"""The resident model across RPC workers (dreamstage.serving.rpc), on loopback.

Two dreamstage-rpc-server processes hold the tiny model's upper layers and its
output head; this process's CPU holds the embeddings and the first layer.
ggml's scheduler runs serving's and the dream stage's graphs across the three.
Everything is CPU arithmetic, so the split should compute what one process
computes; the tolerances below say how close it comes.
"""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from tiny_model import TinyShape, write_tiny_model
from trainer_testing import ProbedTrainer

from dreamstage.serving import rpc
from dreamstage.serving.resident import ResidentConfig, ResidentModel
from dreamstage.training.walk.trainer import LoraConfig, OptimizerConfig

SHAPE = TinyShape(n_layer=4)
TEXT = "The dream stage trains a small adapter between decode batches, on the same context. "
# Logits: the split computes the same products, but the scheduler copies
# activations between backends and the CPU kernels tile by the graph they are
# in, so the order of a few float32 sums may differ.
LOGITS_ATOL = 1e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    # Linux: the worker gets SIGKILL when this process ends, even by an abort (no teardown runs then)
    import ctypes
    import signal
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG


def start_worker(port: int) -> subprocess.Popen:
    """`dreamstage rpc-worker` on loopback, one thread; returns once it accepts."""
    proc = subprocess.Popen([sys.executable, "-m", "dreamstage", "rpc-worker", "--port", str(port), "--threads", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=_die_with_parent)
    deadline = time.monotonic() + 30
    while rpc.probe(rpc.Endpoint("127.0.0.1", port), timeout_s=0.5) is not None:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"rpc worker on {port} did not start: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.1)
    return proc


def stop_worker(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def workers():
    ports = [_free_port(), _free_port()]
    procs = [start_worker(p) for p in ports]
    yield tuple(f"127.0.0.1:{p}" for p in ports)
    for p in procs:
        stop_worker(p)


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny4"), quant="f32", shape=SHAPE)


def _config(path, **kw) -> ResidentConfig:
    return ResidentConfig(model_path=str(path), n_ctx=256, n_seq=1, n_threads=1, kv_type="f32", flash_attn="off", **kw)


@pytest.fixture(scope="module")
def single(tiny4):
    m = ResidentModel(_config(tiny4))
    yield m
    m.close()


@pytest.fixture(scope="module")
def split(tiny4, workers):
    # -ngl 4 of 5 (4 layers and the output): layer 0 stays here, layers 1-2 go
    # to the first worker, layer 3 and the output head to the second
    m = ResidentModel(_config(tiny4, rpc=workers, n_gpu_layers=SHAPE.n_layer, tensor_split=(1.0, 1.0)))
    yield m
    m.close()


def _logits(rm: ResidentModel, tokens: list[int]) -> np.ndarray:
    rm.lc.llama_memory_clear(rm.memory, True)
    rm.decode_entries([(t, i, 0, True) for i, t in enumerate(tokens)])
    return np.stack([np.ctypeslib.as_array(rm.lc.llama_get_logits_ith(rm.ctx, i), shape=(rm.n_vocab,)).copy()
                     for i in range(len(tokens))])


# -- parsing and the trust rule ---------------------------------------------------------------


def test_endpoints_are_parsed_and_bad_ones_named():
    assert [str(e) for e in rpc.parse_endpoints("127.0.0.1:5000, localhost:5001")] == ["127.0.0.1:5000",
                                                                                       "localhost:5001"]
    for bad in ("127.0.0.1", "127.0.0.1:0", "host:99999", ":80", "h:8x", "::1:80"):
        with pytest.raises(ValueError, match="rpc endpoint"):
            rpc.parse_endpoints(bad)
    with pytest.raises(ValueError, match="twice"):
        rpc.parse_endpoints("127.0.0.1:5000,127.0.0.1:5000")
    assert rpc.parse_tensor_split("1, 2.5,0") == (1.0, 2.5, 0.0)
    for bad in ("1,x", "-1,2", "0,0", "nan"):
        with pytest.raises(ValueError, match="tensor_split"):
            rpc.parse_tensor_split(bad)


def test_non_loopback_workers_are_refused_unless_allowed():
    from dreamstage.server.settings import ServerSettings

    with pytest.raises(ValueError, match=r"10\.1\.2\.3:50052 is not a loopback address"):
        ServerSettings(rpc=("127.0.0.1:50052", "10.1.2.3:50052"), state_dir=None)
    s = ServerSettings(rpc=("10.1.2.3:50052",), rpc_allow_remote=True, state_dir=None, tensor_split=(1.0, 3.0))
    assert s.resident_config().rpc == ("10.1.2.3:50052",)
    assert s.resident_config().tensor_split == (1.0, 3.0)


def test_serve_flags_reach_the_settings_and_bad_ones_exit_2(capsys):
    from dreamstage import cli

    args = cli.build_parser().parse_args(["serve", "--rpc", "127.0.0.1:7001,127.0.0.1:7002", "--tensor-split",
                                          "1,2", "--split-mode", "layer", "--no-train"])
    s = cli.serve_settings(args)
    assert s.rpc == ("127.0.0.1:7001", "127.0.0.1:7002") and s.tensor_split == (1.0, 2.0)
    assert cli.main(["serve", "--rpc", "192.168.9.9:7001", "--no-train", "--port", "0"]) == 2
    assert "192.168.9.9:7001 is not a loopback address" in capsys.readouterr().err


def test_worker_refuses_a_non_loopback_bind_without_the_flag():
    r = subprocess.run([sys.executable, "-m", "dreamstage", "rpc-worker", "--host", "0.0.0.0", "--port", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not a loopback address" in r.stderr


def test_an_unreachable_worker_is_named_not_fatal(tiny4):
    port = _free_port()
    with pytest.raises(ValueError, match=f"rpc worker 127.0.0.1:{port} is not reachable"):
        ResidentModel(_config(tiny4, rpc=(f"127.0.0.1:{port}",), n_gpu_layers=2))


# -- serving ----------------------------------------------------------------------------------


def test_the_layers_are_on_the_workers(split, workers):
    names = [d["name"] for d in rpc_devices(workers)]
    assert len(names) == 2 and all(n.startswith("RPC") for n in names)
    before = rpc.traffic()
    _logits(split, split.tokenize(TEXT)[:8])
    assert rpc.traffic().bytes > before.bytes      # the decode crossed the wire


def rpc_devices(endpoints) -> list[dict]:
    from dreamstage import native
    assert not any(d["name"].startswith("RPC") for d in native.devices())   # unless asked for
    return [d for d in native.devices(endpoints) if d["name"].startswith("RPC")]


def test_split_logits_equal_the_single_process_logits(single, split):
    tokens = single.tokenize(TEXT * 2)[:40]
    a, b = _logits(single, tokens), _logits(split, tokens)
    assert np.abs(a).max() > 1.0                   # not a vacuous comparison
    diff = float(np.abs(a - b).max())
    assert diff <= LOGITS_ATOL, diff
    assert (a.argmax(axis=1) == b.argmax(axis=1)).all()


# -- training ---------------------------------------------------------------------------------

LORA = LoraConfig(top_layers=SHAPE.n_layer, seed=5, targets="attn_q,attn_v,ffn_down")


def _window(rm):
    toks = rm.tokenize(TEXT * 4)[:32]
    mask = np.ones(len(toks), np.uint8)
    mask[:5] = 0
    return toks, mask


@pytest.mark.parametrize("exact", [False, True], ids=["plain-walk", "exact-walk"])
def test_a_window_gradient_equals_the_single_process_gradient(monkeypatch, single, split, exact):
    def window_gradient(rm):
        with ProbedTrainer(rm, LORA, cache_type="f32", window=32, chunk=12, exact=exact) as t:
            rs = t.train_window(*_window(rm))
            assert [r.status for r in rs] == ["ok"] * len(rs), [r.message for r in rs]
            return t.gradients(), rs

    g_split, r_split = window_gradient(split)
    g_dream, r_single = window_gradient(single)
    # the reference: one process computing ggml's own ops, as the split graph does
    # (a graph wholly on the CPU otherwise takes the dream stage's CPU kernels,
    # whose float32 sums run in another order: dream-fit.cpp)
    monkeypatch.setenv("DREAMSTAGE_CPU_GRAPH", "ggml")
    g_ref, _ = window_gradient(single)
    assert np.linalg.norm(g_ref) > 0
    assert float(np.linalg.norm(g_split - g_ref) / np.linalg.norm(g_ref)) <= 1e-6
    assert float(np.linalg.norm(g_split - g_dream) / np.linalg.norm(g_dream)) <= 1e-5
    assert all(r.rpc_bytes == 0 for r in r_single), [r.rpc_bytes for r in r_single]
    assert all(r.rpc_bytes > 0 for r in r_split)


def test_the_split_optimizer_steps_on_each_device_as_the_host_optimizer(monkeypatch, single, split):
    # two windows a step, clipped: each device accumulates, measures its part of
    # the norm and steps its own A and B (dream-optim.cpp); one process with
    # ggml's ops and the host optimizer is the reference
    opt = OptimizerConfig(lr=3e-3, weight_decay=0.05, grad_clip=0.5, accumulate_windows=2)

    def train(rm):
        with ProbedTrainer(rm, LORA, cache_type="f32", window=32, chunk=16, optimizer=opt) as t:
            start = t.lora_parameters()
            for _ in range(4):
                assert [r.status for r in t.train_window(*_window(rm))] == ["ok", "ok"]
            m, v, steps = t.optimizer_state()
            return t.optimizer_on_device, start, t.lora_parameters(), m, v, steps

    on_dev, start, theta_s, m_s, v_s, t_s = train(split)
    monkeypatch.setenv("DREAMSTAGE_CPU_GRAPH", "ggml")
    on_host, _, theta_r, m_r, v_r, t_r = train(single)
    assert on_dev and not on_host and t_s == t_r == 2
    assert np.linalg.norm(theta_r - start) > 1e-3 * np.linalg.norm(start)
    assert _rel(m_s, m_r) < 1e-4 and _rel(v_s, v_r) < 1e-4
    assert _rel(theta_s - start, theta_r - start) < 1e-4


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_a_refused_step_names_the_workers_device_and_allocates_nothing(split):
    with ProbedTrainer(split, LORA, cache_type="f32", window=32, chunk=32, exact=False) as t:
        held = t.held_mib()
        t.set_budget(held + 0.05)
        t.begin_window(*_window(split))
        r = t.micro_step()
        assert r.status == "refused", r.message
        assert r.refused_device.startswith("RPC"), (r.refused_device, r.message)
        assert r.refused_device in r.message
        assert t.held_mib() == pytest.approx(held)



# -- a worker that dies -----------------------------------------------------------------------


def test_a_killed_worker_fails_the_step_names_the_worker_and_a_restart_recovers(tiny4, single, split):
    ports = [_free_port(), _free_port()]
    procs = [start_worker(p) for p in ports]
    endpoints = tuple(f"127.0.0.1:{p}" for p in ports)
    rm = ResidentModel(_config(tiny4, rpc=endpoints, n_gpu_layers=SHAPE.n_layer, tensor_split=(1.0, 1.0)))
    try:
        t = ProbedTrainer(rm, LORA, cache_type="f32", window=32, chunk=12)
        t.begin_window(*_window(rm))
        assert t.micro_step().status == "ok"
        stop_worker(procs[1])                       # between two chunks of the window
        r = t.micro_step()
        assert r.status == "error" and endpoints[1] in r.message, r
        assert rpc.failed_worker(endpoints) == endpoints[1] and rpc.failed_worker(endpoints[:1]) is None
        t.close()
        rm.close()                                  # its buffers on the dead worker are dropped, not awaited
        # this process and its other models are untouched
        tokens = single.tokenize(TEXT)[:16]
        assert np.array_equal(_logits(single, tokens), _logits(single, tokens))
        assert np.abs(_logits(split, tokens) - _logits(single, tokens)).max() <= LOGITS_ATOL
        with pytest.raises(ValueError, match=f"rpc worker {endpoints[1]} is not reachable"):
            ResidentModel(_config(tiny4, rpc=endpoints, n_gpu_layers=SHAPE.n_layer, tensor_split=(1.0, 1.0)))
        procs[1] = start_worker(ports[1])           # restarted: the model loads and trains again
        rm = ResidentModel(_config(tiny4, rpc=endpoints, n_gpu_layers=SHAPE.n_layer, tensor_split=(1.0, 1.0)))
        with ProbedTrainer(rm, LORA, cache_type="f32", window=32, chunk=12) as t:
            assert [r.status for r in t.train_window(*_window(rm))] == ["ok"] * 3
    finally:
        rm.close()
        for p in procs:
            stop_worker(p)


def test_health_is_failing_and_names_a_failed_worker(monkeypatch):
    import asyncio
    from types import SimpleNamespace

    from dreamstage.server import status_routes

    engine = SimpleNamespace(running=True, failing=None, n_seq=1, busy_slots=lambda: 0, queue_depth=0,
                             adapter_version=0)
    model = SimpleNamespace(config=SimpleNamespace(rpc=("127.0.0.1:7001",)))
    service = SimpleNamespace(engine=engine, model=model, follower=None)
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(service=service)))
    monkeypatch.setattr(rpc, "traffic", lambda: rpc.Traffic(10, 10, 0, ""))
    assert asyncio.run(status_routes.health(request)).status_code == 200
    monkeypatch.setattr(rpc, "traffic", lambda: rpc.Traffic(10, 10, 1, "127.0.0.1:7001"))
    resp = asyncio.run(status_routes.health(request))
    assert resp.status_code == 503 and b"RPC worker at 127.0.0.1:7001 failed" in resp.body


def test_a_server_whose_worker_dies_fails_the_job_and_reports_503(tmp_path, tiny4):
    import httpx
    from background_server import BackgroundServer

    from dreamstage.server.settings import ServerSettings

    ports = [_free_port(), _free_port()]
    procs = [start_worker(p) for p in ports]
    endpoints = tuple(f"127.0.0.1:{p}" for p in ports)
    settings = ServerSettings(model=str(tiny4), ctx=256, parallel=1, threads=1, state_dir=str(tmp_path),
                              drift_guard=False, rpc=endpoints, n_gpu_layers=SHAPE.n_layer, tensor_split=(1.0, 1.0))
    try:
        with BackgroundServer(settings) as srv, httpx.Client(base_url=srv.url, timeout=120,
                                                             headers={"Content-Type": "application/json"}) as http:
            assert http.get("/health").status_code == 200
            jid = http.post("/train", json={"text": TEXT * 3, "window": 32, "chunk": 16, "epochs": 1000}).json()["id"]
            deadline = time.monotonic() + 120
            while http.get(f"/train/{jid}").json()["progress"]["step"] < 2:
                assert time.monotonic() < deadline, "the job never took two steps"
                time.sleep(0.05)
            assert http.get(f"/train/{jid}").json()["progress"]["rpc_bytes"] > 0
            stop_worker(procs[0])
            while (job := http.get(f"/train/{jid}").json())["state"] == "running":
                assert time.monotonic() < deadline, "the job did not fail"
                time.sleep(0.05)
            assert job["state"] == "error" and endpoints[0] in job["message"], job
            health = http.get("/health")
            assert health.status_code == 503 and endpoints[0] in health.json()["error"]
            r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
            assert r.status_code == 503 and endpoints[0] in r.text, r.text
    finally:
        for p in procs:
            stop_worker(p)
