"""Faults (issue 15): kill -9 mid-step, SIGTERM, a full state directory, a storm of
client disconnects, and a refusal in the middle of a job.

Most run on the tiny model (tests/tiny_model.py), whose micro-steps take
milliseconds; the SIGTERM test uses the default model so that a micro-step
and a stream are surely in flight when the signal lands. Waits are bounded
by deadlines, not asserted as timings.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from background_server import BackgroundServer

from dreamstage.adapters.files import file_sha256, save_lora
from dreamstage.server.settings import ServerSettings
from dreamstage.training.jobs.spec import GATE_SLACK_MIB

JSON = {"Content-Type": "application/json"}
LESSON = "A lesson about moons and tides, repeated many times over. " * 20
FINAL = {"done", "cancelled", "refused", "error", "interrupted"}


def wait_for(pred, what: str, timeout: float = 120.0, every: float = 0.05, show=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"gave up waiting for {what}" + (f": {show()}" if show else ""))


def tiny_lora(path: Path, seed: int = 7) -> Path:
    """A GGUF LoRA for the tiny model's attn_q (64 x 64), rank 2, nonzero B so it changes outputs."""
    rng = np.random.default_rng(seed)
    factors = {(layer, "attn_q"): (rng.normal(0, 0.1, (2, 64)), rng.normal(0, 0.1, (64, 2))) for layer in (0, 1)}
    return save_lora(path, factors, alpha=4.0, model_arch="llama")


# -- a server in its own process ------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: str | None, state: Path, *extra: str, ctx: int = 512, parallel: int = 2):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "dreamstage", "serve", "--state-dir", str(state), "--port", str(self.port),
               "--ctx", str(ctx), "--parallel", str(parallel), "--threads", "1", *extra]
        if model:
            cmd += ["--model", model]
        self.log = state.parent / f"server-{self.port}.log"
        self._out = open(self.log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=self.url, timeout=120, headers=JSON)
        wait_for(self._up, f"the server on port {self.port} (log {self.log})")

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the server exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
        try:
            return self.http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, sig=signal.SIGKILL, timeout: float = 120.0) -> int:
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self.http.close()
            self._out.close()


def store_rows(state: Path) -> tuple[str, dict[int, str], list[Path]]:
    """integrity_check, {job id: state}, and leftover temp files, read straight from disk."""
    conn = sqlite3.connect(state / "dreamstage.sqlite3")
    try:
        check = conn.execute("PRAGMA integrity_check").fetchone()[0]
        jobs = dict(conn.execute("SELECT id, state FROM jobs"))
    finally:
        conn.close()
    temps = [p for p in (state / "adapters").rglob("*") if p.name.endswith(".tmp")]
    return check, jobs, temps


@pytest.fixture(scope="module")
def tiny(tiny_model_path) -> str:
    return str(tiny_model_path)


def test_kill_9_during_steps_loses_no_job_and_keeps_the_served_adapter(tiny, tmp_path):
    state = tmp_path / "state"
    lora = tiny_lora(tmp_path / "notes.gguf")
    want = file_sha256(lora)
    accepted: list[int] = []
    server = ServerProcess(tiny, state, "--adapter", str(lora))
    served = server.http.get("/adapters").json()["served"]
    assert served["sha256"] == want and served["version"] == 1
    # Kill at three moments: mid-training, right after a 202, and while a job starts.
    for moment in ("training", "after-202", "starting"):
        if moment == "training":
            for epochs in (1000, 1, 1):
                accepted.append(server.http.post("/train", json={"text": LESSON, "window": 64, "chunk": 32,
                                                                 "epochs": epochs, "rank": 2,
                                                                 "stop_loss": None}).json()["id"])
            jid = accepted[-3]
            wait_for(lambda server=server, jid=jid: server.http.get(f"/train/{jid}").json()["progress"]["step"] >= 3,
                     "three steps")
        elif moment == "after-202":
            r = server.http.post("/train", json={"text": LESSON, "window": 64, "epochs": 2, "rank": 2})
            assert r.status_code == 202
            accepted.append(r.json()["id"])
        else:
            r = server.http.post("/train", json={"text": LESSON * 3, "window": 64, "epochs": 3, "rank": 2})
            accepted.append(r.json()["id"])
            wait_for(lambda server=server: server.http.get(f"/train/{accepted[-1]}").json()["state"] != "queued",
                     "the start", every=0.002)
        assert server.stop(signal.SIGKILL) == -signal.SIGKILL
        check, jobs, temps = store_rows(state)
        assert check == "ok" and temps == []
        assert set(accepted) <= set(jobs), f"lost jobs: {set(accepted) - set(jobs)}"
        assert file_sha256(lora) == want
        server = ServerProcess(tiny, state)          # restart: recovery, then the served adapter reloads
        listing = server.http.get("/adapters").json()
        assert listing["served_version"] == 1 and listing["served_error"] is None
        stored = state / listing["served"]["path"]
        assert listing["served"]["sha256"] == want == file_sha256(stored)
        for jid in accepted:
            view = server.http.get(f"/train/{jid}").json()
            assert view["state"] in {"queued", "starting", "running", *FINAL}, view
            if jobs[jid] in ("starting", "running", "paused"):      # in flight at the kill: reported, not lost
                assert view["state"] == "interrupted", view
        out = server.http.post("/v1/completions", json={"prompt": "The sky", "max_tokens": 4, "temperature": 0})
        assert out.status_code == 200 and out.json()["adapter_version"] == 1
    server.stop(signal.SIGKILL)


def test_sigterm_ends_streams_with_an_error_event_waits_for_the_step_and_marks_the_job(tmp_path):
    state = tmp_path / "state"
    server = ServerProcess(None, state, ctx=1024, parallel=2)
    job = server.http.post("/train", json={"text": LESSON, "window": 32, "chunk": 32, "epochs": 1000,
                                           "stop_loss": None, "rank": 2})
    jid = job.json()["id"]
    wait_for(lambda: server.http.get(f"/train/{jid}").json()["progress"]["step"] >= 1, "a micro-step", timeout=300)
    lines: list[str] = []
    first = threading.Event()

    def stream():
        body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True,
                "grammar": 'root ::= "la "{300}'}
        with httpx.Client(base_url=server.url, timeout=300, headers=JSON) as c:
            try:
                with c.stream("POST", "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            lines.append(line[6:])
                            first.set()
            except httpx.HTTPError as e:
                lines.append(f"transport error: {e}")
            first.set()
    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(300)
    code = server.stop(signal.SIGTERM, timeout=300)
    t.join(60)
    assert code == 0, server.log.read_text()[-3000:]
    assert "[DONE]" not in lines
    last = json.loads(lines[-1])
    assert "error" in last and "shutting down" in last["error"]["message"], lines[-3:]
    _, jobs, temps = store_rows(state)
    assert jobs[jid] == "interrupted" and temps == []
    assert "Traceback" not in server.log.read_text()


# -- a full state directory ---------------------------------------------------------------------
@pytest.fixture()
def small_disk(tmp_path):
    """A 2 MiB tmpfs (root); where mounting is not allowed, None."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True).returncode:
        yield None
        return
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def open_files() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass                      # closed meanwhile (the listing's own fd, a socket of another thread)
    return out


def fill(directory: Path) -> None:
    """Fill the file system to its last byte. Unbuffered: a buffered writer kept
    the part of a write that did not fit and raised again when it closed, or
    not, depending on how much space the state directory left (the test failed
    once a progress row grew by two fields)."""
    with open(directory / "ballast", "wb", buffering=0) as f:
        for size in (65536, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass


@pytest.mark.parametrize("mode", ["full", "blocked"])
def test_a_full_state_directory_fails_the_job_cleanly_and_serving_goes_on(tiny, tmp_path, small_disk, mode):
    if mode == "full" and small_disk is None:
        pytest.skip("mounting a small tmpfs is not allowed here; the 'blocked' case still runs")
    state = (small_disk if mode == "full" else tmp_path) / "state"
    lora = tiny_lora(tmp_path / "notes.gguf")
    settings = ServerSettings(model=tiny, ctx=512, parallel=2, threads=1, state_dir=str(state), adapter=str(lora))
    with BackgroundServer(settings) as srv, httpx.Client(base_url=srv.url, timeout=120, headers=JSON) as c:
        before = c.post("/v1/completions", json={"prompt": "The sky", "max_tokens": 8, "temperature": 0}).json()
        if mode == "blocked":     # the save cannot create adapters/fresh/ (root ignores chmod; a file blocks it)
            (state / "adapters").mkdir(exist_ok=True)
            (state / "adapters" / "fresh").write_text("a file where the adapter's folder would go")
        # "full": long enough to be running when the disk fills after its first step
        body = {"text": LESSON, "window": 64, "chunk": 64, "epochs": 30 if mode == "full" else 2, "rank": 2,
                "out": "fresh", "stop_loss": None}
        jid = c.post("/train", json=body).json()["id"]
        wait_for(lambda: c.get(f"/train/{jid}").json()["progress"]["step"] >= 1, "a step")
        if mode == "full":
            fill(small_disk)      # receipts and the save both need space now
        view = wait_for(lambda: (v := c.get(f"/train/{jid}").json())["state"] in FINAL and v, "the job's end")
        assert view["state"] == "error", view
        if mode == "blocked":
            assert "saving adapter fresh v1 failed" in view["message"] and "unchanged" in view["message"], view
        else:
            assert "full" in view["message"] or "No space" in view["message"], view
        assert not [p for p in (state / "adapters").rglob("*.tmp")]
        # every writer closed: no handle on a (deleted) temp file keeps its space
        assert not [f for f in open_files() if str(state / "adapters") in f], open_files()
        served = c.get("/adapters").json()["served"]
        assert served["name"] == "notes" and file_sha256(state / served["path"]) == served["sha256"]
        after = c.post("/v1/completions", json={"prompt": "The sky", "max_tokens": 8, "temperature": 0}).json()
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        if mode == "full":
            r = c.post("/train", json={"text": LESSON, "window": 64})
            assert r.status_code in (503, 507) and r.json()["error"]["code"] in ("insufficient_storage",
                                                                                   "storage_unavailable"), r.text
            assert view.get("persisted") is False
            r = c.post("/adapters/notes/promote")              # booking a promotion needs a write too
            assert r.status_code == 507 and r.json()["error"]["code"] == "insufficient_storage", r.text
            assert c.get("/adapters").json()["served_version"] == 1
            (small_disk / "ballast").unlink()                     # space again: the error is written
            wait_for(lambda: sqlite3.connect(state / "dreamstage.sqlite3").execute(
                "SELECT state FROM jobs WHERE id=?", (jid,)).fetchone()[0] == "error", "the error on disk")
            assert c.post("/train", json={"text": LESSON, "window": 64, "rank": 2}).status_code == 202


# -- clients that leave -----------------------------------------------------------------------
def test_a_storm_of_disconnects_frees_every_slot(tiny, tmp_path):
    settings = ServerSettings(model=tiny, ctx=1024, parallel=4, threads=1, max_queue=64)
    with BackgroundServer(settings) as srv:
        engine = srv.service.engine
        body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0.8, "stream": True}

        def leave(i):
            with httpx.Client(base_url=srv.url, timeout=120, headers=JSON) as c:
                with c.stream("POST", "/v1/completions", json=body) as r:
                    for k, _ in enumerate(r.iter_lines()):
                        if k >= i % 5:
                            break              # closes the connection mid-stream
        threads = [threading.Thread(target=leave, args=(i,)) for i in range(48)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        wait_for(lambda: engine.busy_slots() == 0 and engine._outstanding == 0, "every slot freed")
        assert engine.stats.requests.get("cancelled", 0) > 0
        with httpx.Client(base_url=srv.url, timeout=120, headers=JSON) as c:
            r = c.post("/v1/completions", json={"prompt": "The sky", "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200 and c.get("/health").json()["status"] == "ok"


# -- a refusal mid-job does not touch serving ----------------------------------------------------
PROMPTS = ["The sky is", "Once upon a time", "def main():", "Zeebo lives in"]


def greedy(c) -> list[str]:
    return [c.post("/v1/completions",
                   json={"prompt": p, "max_tokens": 24, "temperature": 0}).json()["choices"][0]["text"]
            for p in PROMPTS]


def test_a_refusal_in_the_middle_of_a_job_leaves_serving_byte_identical(tiny, tmp_path):
    settings = ServerSettings(model=tiny, ctx=512, parallel=2, threads=1, state_dir=str(tmp_path / "state"))
    with BackgroundServer(settings) as srv, httpx.Client(base_url=srv.url, timeout=120, headers=JSON) as c:
        baseline = greedy(c)
        # The gate's need depends on what serving has reserved and on the step shaper's
        # chunk sizes, so the budget is found, not fixed: from just above the gate's slack
        # upwards, the first budget under which the job is refused at some chunk and then
        # trains on at a smaller one. (On the tiny model: 80 MiB
        # refuses chunks 56 and 32 after the first step and trains at 16.)
        view = None
        for extra in (4, 8, 12, 16, 20, 24, 32, 48):
            body = {"text": LESSON, "window": 64, "chunk": 64, "epochs": 1000,
                    "stop_loss": None, "rank": 2,
                    "memory_budget_mib": GATE_SLACK_MIB + extra, "promote": "never"}
            jid = c.post("/train", json=body).json()["id"]
            got = wait_for(lambda jid=jid: (v := c.get(f"/train/{jid}").json())["state"] in FINAL and v
                           or (v["refusals"] and v["progress"]["step"] >= 2 and v), "a refusal, then steps")
            if got["state"] == "running":
                view = got
                break
            assert got["state"] == "refused", got
        assert view is not None, "no budget gave a refusal inside a running job"
        assert view["state"] == "running" and view["refusals"]
        assert view["progress"]["current_chunk"] < max(r["refused_chunk_tokens"] for r in view["refusals"])
        during = greedy(c)
        assert c.get(f"/train/{jid}").json()["state"] == "running"
        c.post(f"/train/{jid}/cancel")
        after = greedy(c)
        assert during == baseline and after == baseline


# -- a cancelled job gives its memory back ----------------------------------------------------------
def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def test_a_cancelled_job_gives_the_trainers_memory_back(tmp_path):
    settings = ServerSettings(ctx=1024, parallel=2, threads=1, state_dir=str(tmp_path / "state"))
    with BackgroundServer(settings) as srv, httpx.Client(base_url=srv.url, timeout=120, headers=JSON) as c:
        c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        before = rss_mib()
        for _ in range(2):       # twice: what one job left behind would add up
            body = {"text": "Tides are caused by the moon. " * 40, "window": 128, "chunk": 64, "epochs": 1000,
                    "stop_loss": None, "rank": 32,
                    "targets": "attn_q,attn_k,attn_v,attn_output,ffn_gate,ffn_up,ffn_down"}
            jid = c.post("/train", json=body).json()["id"]
            wait_for(lambda jid=jid: c.get(f"/train/{jid}").json()["progress"]["step"] >= 2, "two steps", timeout=300)
            during = rss_mib()
            assert c.post(f"/train/{jid}/cancel").json()["state"] == "cancelled"
            # Rank 32 on every target: adapter, gradients and AdamW state are over 100 MiB, so a
            # trainer left alive stands out. (At rank 8, q and v: 220 MiB
            # before, 360-388 while training, 222-233 after, 244-251 without the malloc_trim.)
            assert during - before > 50, (before, during)
            wait_for(lambda during=during: rss_mib() - before < 0.25 * (during - before), "the memory to come back",
                     timeout=60, show=lambda during=during: (before, during, rss_mib()))
