"""The resident model across RPC workers (dreamstage.serving.rpc), on loopback.

Two dreamstage-rpc-server processes hold the tiny model's upper layers and its
output head; this process's CPU holds the embeddings and the first layer.
ggml's scheduler runs serving's and the dream stage's graphs across the three.
Everything is CPU arithmetic, so the split should compute what one process
computes; the tolerances below say how close it comes.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
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
                                          "1,2", "--split-mode", "layer", "--rpc-dead-after", "5", "--no-train"])
    s = cli.serve_settings(args)
    assert s.rpc == ("127.0.0.1:7001", "127.0.0.1:7002") and s.tensor_split == (1.0, 2.0)
    assert s.resident_config().rpc_dead_after_s == 5.0
    assert cli.main(["serve", "--rpc", "127.0.0.1:7001", "--rpc-dead-after", "1", "--no-train", "--port", "0"]) == 2
    assert "rpc_dead_after_s" in capsys.readouterr().err
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


def test_a_listener_that_is_not_a_worker_is_named_not_fatal(tiny4):
    """Something that accepts the connection but does not answer the RPC handshake (a worker
    that died just after the probe, another service on that port, a stopped worker or one busy
    with another client): the load fails with an error naming it, and this process goes on
    (ggml's client aborted it, or waited for ever on a silent one)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    mode = ["hang up"]
    held: list[socket.socket] = []

    def serve():
        with contextlib.suppress(OSError):
            while True:
                c, _ = listener.accept()
                if mode[0] == "silent":
                    held.append(c)                     # accepted, never answered
                    continue
                with c:
                    c.settimeout(2)
                    with contextlib.suppress(OSError):
                        c.recv(64)
                        c.sendall(b"" if mode[0] == "hang up" else b"HTTP/1.1 400 Bad Request\r\n\r\n")
    threading.Thread(target=serve, daemon=True).start()
    try:
        for m in ("hang up", "another protocol", "silent"):
            mode[0] = m
            t0 = time.monotonic()
            with pytest.raises(ValueError, match=f"rpc worker 127.0.0.1:{port} did not answer the RPC handshake"):
                ResidentModel(_config(tiny4, rpc=(f"127.0.0.1:{port}",), n_gpu_layers=2, rpc_dead_after_s=2.0))
            # the silent one: the handshake's deadline, the silence bound where it is below 10 s
            assert time.monotonic() - t0 < (8 if m == "silent" else 30), m
    finally:
        listener.close()
        for c in held:
            c.close()


def test_a_refused_connection_leaves_no_descriptor_open():
    """ggml's client, asked for a worker where nothing listens (one that died between the probe and
    the connection), fails without keeping the socket it made."""
    add_server = rpc._proc("ggml_backend_rpc_add_server", ctypes.c_void_p, ctypes.c_char_p)

    def sockets() -> int:
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        return n
    before = sockets()
    for _ in range(3):
        assert not add_server(f"127.0.0.1:{_free_port()}".encode())
    assert sockets() == before


# -- serving ----------------------------------------------------------------------------------


def test_the_layers_are_on_the_workers(split, workers):
    names = [d["name"] for d in rpc_devices(workers)]
    assert len(names) == 2 and all(n.startswith("RPC") for n in names)
    before = rpc.traffic()
    _logits(split, split.tokenize(TEXT)[:8])
    assert rpc.traffic().bytes > before.bytes      # the decode crossed the wire


def test_the_connections_to_the_workers_fail_once_a_host_stops_answering(split, workers):
    """A host that vanishes (no FIN, no RST) is met within rpc_dead_after_s, not the kernel's
    minutes: each of the model's connections to a worker probes it while idle and bounds its
    unacknowledged sends. Read back from the sockets, and the kernel's keepalive timer armed
    on an idle one (/proc/self/net/tcp, timer 2)."""
    assert split.config.rpc_dead_after_s == rpc.DEAD_AFTER_S == 30.0
    conns = [c for e in workers for c in rpc._watched[e]]
    assert len(conns) >= len(workers)
    for fd, _ in conns:
        s = socket.socket(fileno=os.dup(fd))
        try:
            got = (s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                   s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                   s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                   s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
                   s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
                   *(struct.unpack("ll", s.getsockopt(socket.SOL_SOCKET, o, 16))
                     for o in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO)))
        finally:
            s.close()
        # probes from 15 s idle, failed by 30 s; a wait for the worker's bytes bounded by 30 s
        assert got == (1, 15, 5, 3, 30_000, (30, 0), (30, 0))
    timers = {int(f[9]): f[5].split(":")[0] for f in
              (line.split() for line in open("/proc/self/net/tcp").read().splitlines()[1:]) if len(f) > 9}
    assert any(timers.get(inode) == "02" for _, inode in conns)      # an idle connection waits to probe
    with pytest.raises(ValueError, match="rpc_dead_after_s must be within 2 .. 3600 seconds, got 0.5"):
        _config("unused.gguf", rpc=workers, rpc_dead_after_s=0.5).validate()


@pytest.mark.parametrize("fate", ["stops", "dies"])
def test_a_worker_that_stops_or_dies_while_a_decode_waits_on_it_is_named(tiny4, single, fate):
    """A worker process that hangs on a live host (here: stopped) has a kernel that still answers
    keepalive probes: a decode waiting on it fails once it has been silent for rpc_dead_after_s.
    One that dies while a decode waits on it (stopped first, so the decode is surely waiting)
    fails it at once. Either is named, and this process and its other models go on."""
    port = _free_port()
    proc = start_worker(port)
    endpoint = f"127.0.0.1:{port}"
    rm = ResidentModel(_config(tiny4, rpc=(endpoint,), n_gpu_layers=SHAPE.n_layer, rpc_dead_after_s=2.0))
    try:
        tokens = single.tokenize(TEXT)[:16]
        assert np.abs(_logits(rm, tokens) - _logits(single, tokens)).max() <= LOGITS_ATOL
        failures = rpc.traffic().failures
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()

        def decode():
            with contextlib.suppress(RuntimeError):   # a graph may still return success: the count tells (batch.py)
                _logits(rm, tokens)
        waiting = threading.Thread(target=decode)
        waiting.start()
        if fate == "dies":
            time.sleep(0.5)
            stop_worker(proc)
        waiting.join(30)
        took = time.monotonic() - t0
        assert not waiting.is_alive()
        assert (1.5 < took < 10) if fate == "stops" else (took < 1.5), took
        assert rpc.traffic().failures > failures and rpc.failed_worker((endpoint,)) == endpoint
        assert np.array_equal(_logits(single, tokens), _logits(single, tokens))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        rm.close()
        stop_worker(proc)


class _Choke:
    """A loopback proxy to a worker: it forwards both ways until its clients have sent `after`
    bytes, then forwards nothing more and holds every connection open (a worker process that
    hangs part-way, on a host whose kernel still answers)."""

    def __init__(self, upstream: int, after: int):
        self.upstream, self.after, self.sent = upstream, after, 0
        self.choked = threading.Event()
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.port = self.listener.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                c, _ = self.listener.accept()
                if self.choked.is_set():                # ggml's tries after the failure: refused at once
                    c.close()
                    continue
                u = socket.create_connection(("127.0.0.1", self.upstream))
                self.conns += [c, u]
                threading.Thread(target=self._pipe, args=(c, u, True), daemon=True).start()
                threading.Thread(target=self._pipe, args=(u, c, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, counted: bool) -> None:
        with contextlib.suppress(OSError):
            while not self.choked.is_set():
                data = src.recv(1 << 16)
                if not data:                    # shutdown, not close alone: it wakes the other pipe's recv
                    dst.shutdown(socket.SHUT_RDWR)
                    return
                if counted:
                    self.sent += len(data)
                    if self.sent > self.after:
                        self.choked.set()
                if self.choked.is_set():
                    return                      # held: read no more, answer nothing
                dst.sendall(data)

    def close(self) -> None:
        self.listener.close()
        for c in self.conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()


def test_a_worker_that_hangs_while_the_model_uploads_fails_the_load_naming_it(tiny4):
    """The silence bound holds from each connection's handshake on, before the model has loaded:
    a worker that stops answering part-way through the upload fails the load within it."""
    port = _free_port()
    proc = start_worker(port)
    choke = _Choke(port, after=256 << 10)            # past the handshake and the buffers' set-up
    endpoint = f"127.0.0.1:{choke.port}"
    t0 = time.monotonic()
    try:
        with pytest.raises(ValueError, match=f"the RPC worker at {endpoint} failed while the model loaded: it "
                                             "closed the connection or was silent for 2 s"):
            ResidentModel(_config(tiny4, rpc=(endpoint,), n_gpu_layers=SHAPE.n_layer, rpc_dead_after_s=2.0))
        took = time.monotonic() - t0
        assert choke.choked.is_set() and took < 10, took
    finally:
        choke.close()
        stop_worker(proc)


def rpc_devices(endpoints) -> list[dict]:
    from dreamstage.native import ggml_registry
    assert not any(d["name"].startswith("RPC") for d in ggml_registry.devices())   # unless asked for
    return [d for d in ggml_registry.devices(endpoints) if d["name"].startswith("RPC")]


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


def test_a_killed_worker_fails_the_step_and_a_reload_resumes_from_the_checkpoint(tiny4, single, split):
    ports = [_free_port(), _free_port()]
    procs = [start_worker(p) for p in ports]
    endpoints = tuple(f"127.0.0.1:{p}" for p in ports)
    rm = ResidentModel(_config(tiny4, rpc=endpoints, n_gpu_layers=SHAPE.n_layer, tensor_split=(1.0, 1.0)))
    try:
        t = ProbedTrainer(rm, LORA, cache_type="f32", window=32, chunk=12)
        assert [r.status for r in t.train_window(*_window(rm))] == ["ok"] * 3
        cp = t.checkpoint()                         # between windows: after the first update
        assert cp.updates == 1
        t.begin_window(*_window(rm))
        assert t.micro_step().status == "ok"
        assert rpc.hung_up(endpoints) is None
        stop_worker(procs[1])                       # between two chunks of the window
        deadline = time.monotonic() + 5             # the kernel tells before any command fails
        while rpc.hung_up(endpoints) != endpoints[1]:
            assert time.monotonic() < deadline, "the closed connection was not seen"
            time.sleep(0.01)
        r = t.micro_step()
        assert r.status == "error" and endpoints[1] in r.message, r
        assert rpc.failed_worker(endpoints) == endpoints[1] and rpc.failed_worker(endpoints[:1]) is None
        # this process and its other models are untouched
        tokens = single.tokenize(TEXT)[:16]
        assert np.array_equal(_logits(single, tokens), _logits(single, tokens))
        assert np.abs(_logits(split, tokens) - _logits(single, tokens)).max() <= LOGITS_ATOL
        with pytest.raises(ValueError, match=f"rpc worker {endpoints[1]} is not reachable"):
            rm.reload()                             # the worker is still gone: named, nothing loaded
        procs[1] = start_worker(ports[1])
        loads = rm.loads
        rm.reload()                                 # the same object, the layers uploaded again
        assert rm.loads == loads + 1 and rpc.failed_worker(endpoints) is None
        assert np.abs(_logits(rm, tokens) - _logits(single, tokens)).max() <= LOGITS_ATOL
        t.reopen(cp)                                # the trainer from its checkpoint, on the new context
        assert [r.status for r in t.train_window(*_window(rm))] == ["ok"] * 3
        resumed = (t.lora_parameters(), *t.optimizer_state())
        t.close()
        with ProbedTrainer(split, LORA, cache_type="f32", window=32, chunk=12) as ref:   # nothing interrupted
            for _ in range(2):
                ref.train_window(*_window(split))
            expected = (ref.lora_parameters(), *ref.optimizer_state())
        assert expected[3] == resumed[3] == 2
        for a, b in zip(resumed[:3], expected[:3], strict=True):
            assert np.array_equal(a, b), float(np.abs(a - b).max())
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


def test_only_the_engine_moves_a_held_job_on_and_a_restart_interrupts_it(tmp_path):
    from types import SimpleNamespace

    from dreamstage.training.jobs.request import parse_train_request
    from dreamstage.training.jobs.store import InvalidTransition, JobStore
    from dreamstage.training.jobs.submit import JobSubmitter

    with JobStore(tmp_path) as store:
        jid = store.submit(parse_train_request({"text": "some text", "window": 64}))["id"]
        for state in ("starting", "running", "held"):
            store.transition(jid, state)
        submitter = JobSubmitter(store, SimpleNamespace(forget=lambda jid: None), None, None)
        with pytest.raises(InvalidTransition, match="goes on by itself"):
            submitter.transition(jid, "running")
        with pytest.raises(InvalidTransition, match="from held"):
            store.transition(jid, "paused")
        assert store.state(jid) == "held"
        store.transition(jid, "running")            # the engine's move, once the worker is back
        store.transition(jid, "held")
    with JobStore(tmp_path) as store:               # its checkpoint was in memory: interrupted, not lost
        assert store.recovered == [jid] and store.state(jid) == "interrupted"


def _wait_for(http, jid: int, states: tuple[str, ...], deadline: float) -> dict:
    while (job := http.get(f"/train/{jid}").json())["state"] not in states:
        assert time.monotonic() < deadline, f"job {jid} never reached {states}: {job['state']} {job['message']}"
        time.sleep(0.05)
    return job


def _settled_step(http, jid: int) -> int:
    """A paused job's step count once the step in flight as it paused has ended (unchanged for 1 s)."""
    step, since = http.get(f"/train/{jid}").json()["progress"]["step"], time.monotonic()
    while time.monotonic() - since < 1.0:
        time.sleep(0.1)
        now = http.get(f"/train/{jid}").json()["progress"]["step"]
        if now != step:
            step, since = now, time.monotonic()
    return step


@contextlib.contextmanager
def _stopped_after_first_step(monkeypatch, out: str):
    """Block the training thread once the job writing `out` has run its first micro-step (the
    first of its first window's two chunks) until the body ends: the body kills a worker there."""

    from dreamstage.training.jobs.program import JobProgram

    ran, go, original = threading.Event(), threading.Event(), JobProgram._micro_step

    def micro_step(self, lp):
        event = yield from original(self, lp)
        if lp.spec.out == out and not ran.is_set():
            ran.set()
            go.wait(120)
        return event
    monkeypatch.setattr(JobProgram, "_micro_step", micro_step)
    try:
        yield ran
    finally:
        go.set()


@contextlib.contextmanager
def _split_server(state_dir, model):
    """A server with the model split over two fresh loopback workers: (client, workers, their
    ports, endpoints). A test may replace a worker in the list; all are stopped at the end."""
    import httpx
    from background_server import BackgroundServer

    from dreamstage.server.settings import ServerSettings

    ports = [_free_port(), _free_port()]
    procs = [start_worker(p) for p in ports]
    endpoints = tuple(f"127.0.0.1:{p}" for p in ports)
    settings = ServerSettings(model=str(model), ctx=256, parallel=1, threads=1, state_dir=str(state_dir),
                              drift_guard=False, rpc=endpoints, n_gpu_layers=SHAPE.n_layer, tensor_split=(1.0, 1.0))
    try:
        with BackgroundServer(settings) as srv, httpx.Client(base_url=srv.url, timeout=120,
                                                             headers={"Content-Type": "application/json"}) as http:
            yield http, procs, ports, endpoints
    finally:
        for p in procs:
            stop_worker(p)


def test_a_server_whose_worker_dies_holds_the_job_and_resumes_it_once_the_worker_is_back(monkeypatch, tmp_path,
                                                                                           tiny4):
    from dreamstage.adapters.files import load_lora

    # two chunks a window: a worker killed between them fails the window's second chunk (no pause
    # bound: the step shaper would cut chunks on a loaded machine, and the gradient with them)
    job = {"text": TEXT * 3, "window": 32, "chunk": 16, "epochs": 2, "stop_loss": None, "promote": "never",
           "max_pause_ms": 0}
    with _split_server(tmp_path, tiny4) as (http, procs, ports, endpoints):
        deadline = time.monotonic() + 300
        ref = http.post("/train", json={**job, "out": "ref"}).json()["id"]       # the run nothing interrupts
        progress = _wait_for(http, ref, ("done",), deadline)["progress"]
        steps = progress["step"]
        assert steps == 2 * progress["windows"] * job["epochs"]       # every window two chunks
        with _stopped_after_first_step(monkeypatch, "held") as ran:
            jid = http.post("/train", json={**job, "out": "held"}).json()["id"]
            assert ran.wait(120), "the job never took its first step"
            stop_worker(procs[0])                   # between the first window's two chunks
            while rpc.hung_up(endpoints) != endpoints[0]:
                assert time.monotonic() < deadline, "the closed connection was not seen"
                time.sleep(0.01)
        held = _wait_for(http, jid, ("held", "error", "done"), deadline)
        assert held["state"] == "held" and endpoints[0] in held["message"], held
        # seen before the window's second chunk ran (the kernel had closed the connection): no step failed
        assert "between two steps" in held["message"], held["message"]
        assert http.get(f"/train/{jid}/receipts").json()["receipts"][-1]["status"] == "ok"
        health = http.get("/health")
        assert health.status_code == 503 and endpoints[0] in health.json()["error"]
        r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 503 and endpoints[0] in r.text, r.text
        r = http.post(f"/train/{jid}/resume")
        assert r.status_code == 409 and "goes on by itself" in r.text, r.text
        r = http.post("/adapters/ref/promote")       # it would load onto the dead worker's buffers
        assert r.status_code == 503 and endpoints[0] in r.text, r.text
        time.sleep(1.5)                             # held while the worker is gone
        assert http.get(f"/train/{jid}").json()["state"] == "held"

        procs[0] = start_worker(ports[0])           # back: the server loads the model again, the job goes on
        done = _wait_for(http, jid, ("done", "error", "cancelled"), deadline)
        assert done["state"] == "done", done
        assert http.get("/health").status_code == 200
        assert "dreamstage_model_reloads_total 1.0" in http.get("/metrics").text
        r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert http.post("/adapters/ref/promote").status_code == 200     # adapters load on the new model
        r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["adapter_version"] == 1, r.text
        # the window the worker died in ran again from its start (its first chunk twice); every update once
        assert done["progress"]["step"] == steps + 1
        assert done["progress"]["windows_done"] == http.get(f"/train/{ref}").json()["progress"]["windows_done"]
        a, b = load_lora(tmp_path / "adapters" / "ref" / "v1.gguf")[0], \
            load_lora(tmp_path / "adapters" / "held" / "v1.gguf")[0]
        assert a.keys() == b.keys()
        for k in a:
            for x, y in zip(a[k], b[k], strict=True):
                assert np.array_equal(x, y), (k, float(np.abs(x - y).max()))


def test_a_job_whose_worker_dies_between_steps_is_held_and_can_be_cancelled(tmp_path, tiny4):
    with _split_server(tmp_path, tiny4) as (http, procs, _, endpoints):
        jid = http.post("/train", json={"text": TEXT * 3, "window": 32, "chunk": 16, "epochs": 1000}).json()["id"]
        deadline = time.monotonic() + 120
        while http.get(f"/train/{jid}").json()["progress"]["step"] < 2:
            assert time.monotonic() < deadline, "the job never took two steps"
            time.sleep(0.05)
        assert http.get(f"/train/{jid}").json()["progress"]["rpc_bytes"] > 0
        assert http.post(f"/train/{jid}/pause").status_code == 200
        _settled_step(http, jid)
        receipts = len(http.get(f"/train/{jid}/receipts").json()["receipts"])
        stop_worker(procs[1])
        r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})   # the decode sees it first
        assert r.status_code == 503 and endpoints[1] in r.text, r.text
        assert http.post(f"/train/{jid}/resume").status_code == 200
        held = _wait_for(http, jid, ("held", "error"), deadline)
        assert held["state"] == "held" and endpoints[1] in held["message"], held
        assert "between two steps" in held["message"], held["message"]
        assert len(http.get(f"/train/{jid}/receipts").json()["receipts"]) == receipts    # no step ran
        r = http.post(f"/train/{jid}/cancel")
        assert r.status_code == 200 and r.json()["state"] == "cancelled", r.text
        assert http.get("/health").status_code == 503      # serving waits for the worker too
