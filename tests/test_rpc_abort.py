"""A dead RPC worker met first by a request that needs new memory on it: an error naming
the worker, never an abort of the serving process.

ggml's client learns that a worker is gone only when a command fails; its commands
are then dropped with zeroed answers (vendor/patches/0110-*). `rpc.hung_up` (the
kernel's view of the connection) usually sees a dead worker first; here it is
turned off, so each request below is the first to reach the worker: a prompt longer
than any before, a stored adapter loaded anew, a training job. The server runs in a
subprocess (this file run as a script), so an abort would show as its exit, not take
pytest down.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_rpc import SHAPE, TEXT, _free_port, _settled_step, start_worker, stop_worker
from tiny_model import write_tiny_model

from dreamstage.serving import rpc

DEADLINE_S = 300
# The job that makes the stored adapter, and the one that meets the dead worker.
JOB = {"text": TEXT * 3, "window": 32, "chunk": 16, "epochs": 1, "stop_loss": None, "promote": "never",
       "max_pause_ms": 0}


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny4"), quant="f32", shape=SHAPE)


class _Server:
    """The server in a subprocess with `rpc.hung_up` off, over two loopback workers."""

    def __init__(self, state_dir: Path, model: Path):
        self.ports = [_free_port(), _free_port()]
        self.workers = [start_worker(p) for p in self.ports]
        self.endpoints = tuple(f"127.0.0.1:{p}" for p in self.ports)
        settings = {"model": str(model), "ctx": 256, "parallel": 1, "threads": 1, "state_dir": str(state_dir),
                    "drift_guard": False, "rpc": list(self.endpoints), "n_gpu_layers": SHAPE.n_layer,
                    "tensor_split": [1.0, 1.0]}
        self.log = state_dir / "server.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen([sys.executable, __file__, json.dumps(settings)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log)
        assert self.proc.stdout is not None
        url = self.proc.stdout.readline().decode().strip()
        assert url.startswith("http://"), f"the server did not start: {self.tail()}"
        self.http = httpx.Client(base_url=url, timeout=120, headers={"Content-Type": "application/json"})

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def alive(self) -> None:
        assert self.proc.poll() is None, f"the server exited with {self.proc.returncode}: {self.tail()}"

    def kill_worker(self, i: int) -> None:
        stop_worker(self.workers[i])

    def restart_worker(self, i: int) -> None:
        """Start worker i again and wait until the server has loaded the model again."""
        self.workers[i] = start_worker(self.ports[i])
        deadline = time.monotonic() + DEADLINE_S
        while self.http.get("/health").status_code != 200:
            self.alive()
            assert time.monotonic() < deadline, "the server never loaded the model again"
            time.sleep(0.2)

    def close(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()          # the script's cue to shut down
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for w in self.workers:
            stop_worker(w)


def _complete(srv: _Server, prompt: str, model: str | None = None) -> httpx.Response:
    body: dict = {"prompt": prompt, "max_tokens": 2}
    if model is not None:
        body["model"] = model
    return srv.http.post("/v1/completions", json=body)


def _wait_job(srv: _Server, jid: int, states: tuple[str, ...]) -> dict:
    deadline = time.monotonic() + DEADLINE_S
    while (job := srv.http.get(f"/train/{jid}").json())["state"] not in states:
        srv.alive()
        assert time.monotonic() < deadline, f"job {jid} never reached {states}: {job['state']} {job['message']}"
        time.sleep(0.1)
    return job


def test_requests_that_first_meet_a_dead_worker_get_an_error_naming_it(tmp_path, tiny4):
    srv = _Server(tmp_path, tiny4)
    try:
        dead = srv.endpoints[1]
        # a stored adapter no request has loaded yet (made while both workers live)
        stored = srv.http.post("/train", json={**JOB, "out": "stored"}).json()["id"]
        assert _wait_job(srv, stored, ("done", "error"))["state"] == "done"
        short = "Hello"
        assert _complete(srv, short).status_code == 200

        # a prompt longer than any before: a graph of a shape the context never computed
        srv.kill_worker(1)
        r = _complete(srv, TEXT * 2)
        srv.alive()
        assert r.status_code == 503 and dead in r.text, r.text
        health = srv.http.get("/health")
        assert health.status_code == 503 and dead in health.json()["error"], health.text
        srv.restart_worker(1)

        # the first decode after a reload: its compute buffers were allocated there and never used,
        # so their base is asked for now (the unpatched client aborted here: ggml's assert on NULL)
        srv.kill_worker(1)
        r = _complete(srv, short)
        srv.alive()
        assert r.status_code == 503 and dead in r.text, r.text
        srv.restart_worker(1)

        # a stored adapter loaded anew: its tensors need buffers on the worker
        srv.kill_worker(1)
        r = _complete(srv, short, model="stored@1")
        srv.alive()
        assert r.status_code == 503 and dead in r.text, r.text
        srv.restart_worker(1)
        r = _complete(srv, short, model="stored@1")
        assert r.status_code == 200, r.text

        # a promotion: its adapter would be placed on the dead worker's buffers
        srv.kill_worker(1)
        r = srv.http.post("/adapters/stored/promote", json={"version": 1})
        srv.alive()
        assert r.status_code == 503 and dead in r.text and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "rpc_worker_failed"
        srv.restart_worker(1)

        # a training job starting: its dream stage asks the worker's memory and allocates there
        srv.kill_worker(1)
        jid = srv.http.post("/train", json={**JOB, "out": "after"}).json()["id"]
        job = _wait_job(srv, jid, ("error", "refused", "held", "done"))
        srv.alive()
        assert job["state"] == "error" and dead in job["message"], job
        srv.restart_worker(1)

        # a training step of a running job: an error receipt naming the worker, the job held
        jid = srv.http.post("/train", json={**JOB, "out": "running", "epochs": 1000}).json()["id"]
        deadline = time.monotonic() + DEADLINE_S
        while srv.http.get(f"/train/{jid}").json()["progress"]["step"] < 1:
            assert time.monotonic() < deadline, "the job never took a step"
            time.sleep(0.05)
        assert srv.http.post(f"/train/{jid}/pause").status_code == 200
        step = _settled_step(srv.http, jid)
        srv.kill_worker(1)
        assert srv.http.post(f"/train/{jid}/resume").status_code == 200
        job = _wait_job(srv, jid, ("held", "error", "done"))
        srv.alive()
        assert job["state"] == "held" and dead in job["message"] and "during a micro-step" in job["message"], job
        last = srv.http.get(f"/train/{jid}/receipts").json()["receipts"][-1]
        assert last["status"] == "error" and dead in last["message"], last
        srv.restart_worker(1)
        while (job := srv.http.get(f"/train/{jid}").json())["progress"]["step"] <= step + 1:
            assert job["state"] in ("held", "running") and time.monotonic() < deadline, job
            time.sleep(0.05)
        assert srv.http.post(f"/train/{jid}/cancel").status_code == 200
        assert _complete(srv, TEXT * 2).status_code == 200
        srv.alive()
    finally:
        srv.close()


if __name__ == "__main__":
    # The server for the test above: settings as JSON in argv[1]; prints its URL, serves until stdin closes.
    import faulthandler
    import signal

    from background_server import BackgroundServer

    from dreamstage.server.settings import ServerSettings

    faulthandler.register(signal.SIGUSR1)    # a stuck server's threads, on request
    rpc.hung_up = lambda endpoints: None     # the client itself must be the first to meet a dead worker
    with BackgroundServer(ServerSettings(**json.loads(sys.argv[1]))) as server:
        print(server.url, flush=True)
        sys.stdin.read()


def test_the_tokenizer_waits_out_a_reload_and_names_a_missing_model(tiny_model_path):
    """The engine thread reloads the model in place (a worker came back) while request threads
    tokenize: every call answers as before the reload, none meets freed handles; with no model
    loaded the tokenizer raises WorkerFailed, which the server answers with 503."""
    import threading

    from dreamstage.serving.resident import ResidentConfig, ResidentModel

    model = ResidentModel(ResidentConfig(model_path=str(tiny_model_path), n_ctx=256, n_seq=1, n_threads=1))
    try:
        text = "The river runs past the old mill. " * 8
        want = model.tokenize(text)
        want_text = model.detokenize(want)
        got, errors, stop = [], [], threading.Event()

        def reader():
            while not stop.is_set():
                try:
                    got.append(model.tokenize(text) == want and model.detokenize(want) == want_text)
                except Exception as e:      # noqa: BLE001 - any failure is what this test reports
                    errors.append(e)
        threads = [threading.Thread(target=reader) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            for _ in range(3):
                model.reload()
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert not errors and got and all(got) and model.loads >= 4
        model.close()
        with pytest.raises(rpc.WorkerFailed, match="not loaded"):
            model.tokenize(text)
    finally:
        model.close()
