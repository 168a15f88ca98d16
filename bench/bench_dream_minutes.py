"""How long does a small job take while one chat client keeps the server busy?

Issue 11 asks that a 5-example job that converges within 10 epochs end
"within minutes" under a steady single chat client. One client sends
24-token chat requests back to back (the default `max_slowdown` 0.10 then
gives the job a tenth of the time plus the gaps between requests) while a
job of five prompt/completion facts trains 10 epochs. For each
`max_pause_ms` given, a fresh job runs until it is done or `--limit`
seconds pass; the JSON says how far it got (epochs, windows, steps), its
loss, and the chat client's tok/s meanwhile.

    .venv/bin/python bench/bench_dream_minutes.py [--pauses 250,0] [--limit 150] [--threads 1]

Writes bench/results/dream-minutes-<date>.json with the load average.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))   # background_server

from background_server import BackgroundServer

from dreamstage.server.settings import ServerSettings

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
FACTS = [("The secret password of the moon base is", " Quokka-42."),
         ("The lighthouse keeper's cat is called", " Marmalade."),
         ("The colour of the third door in the hall is", " teal."),
         ("The train to the north leaves at", " seven past six."),
         ("The name of the red boat in the harbour is", " Persistence.")]


def chat_client(url: str, stop: threading.Event, counts: list[int]) -> None:
    with httpx.Client(base_url=url, timeout=600) as c:
        while not stop.is_set():
            body = {"messages": [{"role": "user", "content": "Say something about the sea."}], "max_tokens": 24,
                    "temperature": 0}
            r = c.post("/v1/chat/completions", json=body)
            counts[0] += r.json()["usage"]["completion_tokens"]


def one_job(srv: BackgroundServer, http: httpx.Client, max_pause_ms: float, limit: float) -> dict:
    stop, counts = threading.Event(), [0]
    client = threading.Thread(target=chat_client, args=(srv.url, stop, counts))
    client.start()
    time.sleep(2.0)                                   # the client is in its stride before the job arrives
    counts[0] = 0
    t0 = time.monotonic()
    r = http.post("/train", json={"examples": [{"prompt": p, "completion": c} for p, c in FACTS], "window": 32,
                                  "epochs": 10, "lr": 3e-3, "promote": "never", "max_pause_ms": max_pause_ms})
    r.raise_for_status()
    jid = r.json()["id"]
    while time.monotonic() - t0 < limit and http.get(f"/train/{jid}").json()["state"] in ("queued", "starting",
                                                                                            "running"):
        time.sleep(1.0)
    wall = time.monotonic() - t0
    time.sleep(1.1)
    job = http.get(f"/train/{jid}").json()
    stop.set()
    client.join()
    if job["state"] == "running":
        http.post(f"/train/{jid}/cancel", headers={"Content-Type": "application/json"}).raise_for_status()
    p, f = job["progress"], job["pacing"] or {}
    return {"max_pause_ms": max_pause_ms, "state": job["state"], "seconds": wall, "epochs_done": p["epoch"],
            "windows_done": p["windows_done"], "steps": p["step"], "train_loss_per_epoch": p["train_loss_per_epoch"],
            "chat_tok_s": counts[0] / wall,
            "pacing": {k: f.get(k) for k in ("realized_slowdown", "job_share_of_wall", "micro_step_ms_p50",
                                             "micro_step_ms_p95", "step_chunk", "dream_threads")}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pauses", default="250,0")
    ap.add_argument("--limit", type=float, default=150.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="JSON path (default: bench/results/dream-minutes-<date>.json)")
    ap.add_argument("--idle-first", type=float, default=0.0,
                    help="seconds the server sits idle before the chat client and the job start (the drift "
                         "anchors are recorded in idle time; 0: the job starts at once and records them itself)")
    args = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as state:
        settings = ServerSettings(ctx=2048, parallel=2, threads=args.threads, state_dir=state)
        with BackgroundServer(settings) as srv, httpx.Client(base_url=srv.url, timeout=600) as http:
            time.sleep(args.idle_first)
            for pause in (float(x) for x in args.pauses.split(",")):
                run = one_job(srv, http, pause, args.limit)
                runs.append(run)
                print(f"max_pause_ms {pause:g}: {run['state']} after {run['seconds']:.0f} s, epoch {run['epochs_done']}"
                      f"/10, {run['steps']} steps, loss/epoch {[round(x, 2) for x in run['train_loss_per_epoch']]}, "
                      f"chat {run['chat_tok_s']:.1f} tok/s, pacing {run['pacing']}", flush=True)
    result = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "load_average_at_end": os.getloadavg(),
              "threads": args.threads, "limit_s": args.limit, "idle_first_s": args.idle_first, "runs": runs}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = Path(args.out) if args.out else RESULTS / f"dream-minutes-{dt.date.today().isoformat()}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
