"""A server's first job, as a new user meets it: how long until it trains, and until it is done.

    nice python bench/bench_first_job.py --runs quiet,chat --out bench/results/first-job-2026-12-06.json

Per run: a server on the default model (a fresh state directory, so nothing
is recorded yet, the drift guard on), the README's job (`{"prompt": "The
secret password of the moon base is", "completion": " Quokka-42."}`, window
32, 10 epochs, lr 0.001, promote auto) posted at once. `quiet`: nothing else
is served; `chat`: a thread sends chat completions back to back (a steady
client) until the job ends. Reported: the time from the POST to the job's
first training micro-step (the first receipt in `GET /train/{id}` progress),
to its terminal state, whether it was promoted, the answer at temperature 0
after it, how many drift records were still being made when it first trained,
and the chat client's requests. A run past `--limit` seconds is cancelled and
reported unfinished. docs/benchmarks.md ("A server's first job") quotes it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))   # background_server

from background_server import BackgroundServer
from machine import describe

from dreamstage.server.settings import ServerSettings
from dreamstage.training.jobs.store import TERMINAL

PROMPT = "The secret password of the moon base is"
ANSWER = " Quokka-42."
JOB = {"examples": [{"prompt": PROMPT, "completion": ANSWER}], "window": 32, "epochs": 10, "lr": 0.001,
       "promote": "auto", "out": "moon"}
CHATS = ["Name a colour of the sky.", "What is 2 + 3?", "Say hello in French.", "Name a fruit that is red."]
POLL_S = 0.25
TIMELINE_S = 10.0
TIMELINE_FIELDS = ("epoch", "windows_done", "step", "stopped", "aborted", "current_chunk", "train_ms",
                   "drift_records")


class SteadyClient:
    """Chat completions back to back on a thread of its own until stopped."""

    def __init__(self, url: str):
        self.url, self.done, self.errors = url, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="steady-chat", daemon=True)

    def _loop(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as http:
            i = 0
            while not self._stop.is_set():
                body = {"messages": [{"role": "user", "content": CHATS[i % len(CHATS)]}], "max_tokens": 32}
                try:
                    http.post("/v1/chat/completions", json=body).raise_for_status()
                    self.done += 1
                except httpx.HTTPError:
                    self.errors += 1
                i += 1

    def __enter__(self) -> SteadyClient:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(130)


def run_one(kind: str, threads: int, limit_s: float) -> dict:
    with tempfile.TemporaryDirectory() as state:
        settings = ServerSettings(threads=threads, state_dir=state, drift_guard=True)
        with BackgroundServer(settings) as srv, httpx.Client(base_url=srv.url, timeout=300) as http:
            client = SteadyClient(srv.url) if kind == "chat" else None
            if client is not None:
                client.__enter__()
                time.sleep(2.0)                         # the client is steady before the job comes
            try:
                t0 = time.monotonic()
                r = http.post("/train", json=JOB)
                r.raise_for_status()
                jid = r.json()["id"]
                first = recording = None
                timeline: list[dict] = []                # every TIMELINE_S: where the job's time goes
                while True:
                    job = http.get(f"/train/{jid}").json()
                    now = time.monotonic() - t0
                    if not timeline or now - timeline[-1]["t"] >= TIMELINE_S:
                        p = job["progress"]
                        timeline.append({"t": round(now, 1), "state": job["state"],
                                         **{k: p.get(k) for k in TIMELINE_FIELDS},
                                         "micro_steps": (job.get("pacing") or {}).get("micro_steps")})
                    if first is None and job["progress"].get("step", 0) >= 1:
                        first = now
                        recording = (job["progress"].get("drift_records") or {}).get("pending")
                    if job["state"] in TERMINAL:
                        break
                    if now > limit_s:
                        http.delete(f"/train/{jid}")
                        job = http.get(f"/train/{jid}").json()
                        break
                    time.sleep(POLL_S)
                wall = time.monotonic() - t0
            finally:
                if client is not None:
                    client.__exit__()
            text = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8,
                                                     "temperature": 0}).json()["choices"][0]["text"]
            d = job["progress"].get("drift") or {}
            pacing = job.get("pacing") or {}
            return {"run": kind, "threads": threads, "first_step_s": None if first is None else round(first, 1),
                    "records_pending_at_first_step": recording, "terminal_s": round(wall, 1),
                    "state": job["state"], "finished": job["state"] in TERMINAL and wall <= limit_s,
                    "promoted": bool((job.get("adapter") or {}).get("promoted")), "answer": text,
                    "recalled": ANSWER.strip() in text, "epochs": job["progress"].get("epoch"),
                    "steps": job["progress"].get("step"), "micro_steps": pacing.get("micro_steps"),
                    "realized_slowdown": pacing.get("realized_slowdown"),
                    "chat_requests": client.done if client else 0, "chat_errors": client.errors if client else 0,
                    **{k: d.get(k) for k in ("anchors", "anchors_changed_count", "noise_margin", "drift_kl")},
                    "message": job["message"], "progress": job["progress"], "timeline": timeline}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="quiet,chat", help="comma-separated: quiet, chat (one server each)")
    ap.add_argument("--threads", type=int, default=1, help="the server's threads (0: all cores)")
    ap.add_argument("--limit", type=float, default=900.0, help="seconds after which a run's job is cancelled")
    ap.add_argument("--note", default="", help="a line saying what the run measured (the code's state)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    kinds = args.runs.split(",")
    if any(k not in ("quiet", "chat") for k in kinds):
        sys.exit(f"--runs: each entry is quiet or chat, got {args.runs!r}")
    load = os.getloadavg()
    rows = []
    for kind in kinds:
        rows.append(run_one(kind, args.threads, args.limit))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "note": args.note,
            "machine": describe(), "job": JOB,
            "load_avg_start": load, "load_avg_end": os.getloadavg(), "runs": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
