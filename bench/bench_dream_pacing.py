"""Pacing under load: what do chat clients lose while a job trains?

The question: with N streaming chat clients keeping every slot busy, what
aggregate decode tok/s do they get with no job, with a job paced by
`max_slowdown` 0.10 (the default) and with `share` 0.25; what slowdown does
the pacer itself measure, and how long is one micro-step (p50/p95/max)?

    .venv/bin/python bench/bench_dream_pacing.py [--streams 2] [--seconds 20] [--threads 1]

One `BackgroundServer` (default model, CPU) on a temporary state directory.
Each mode runs the same closed loop of streaming requests (64 tokens,
temperature 0) for `--seconds`; the client counts streamed tokens. The job
(text, window 64, chunk 32, rank 8, many epochs) is submitted before the
loop starts and cancelled after it; its `pacing` figures are the pacer's
own measurements over the same period.

Writes bench/results/dream-pacing-<date>.json.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import tempfile
import threading
import time
from pathlib import Path

import httpx

from dreamstage.server.service import BackgroundServer
from dreamstage.server.settings import ServerSettings

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
PROMPTS = ["Tell me a long story about a lighthouse keeper.", "Explain how bread is made, step by step.",
           "Describe a walk through a busy market.", "Write about the history of sailing ships."]
LESSON = ("Dreamstage keeps one model resident. Between decode batches it trains a small adapter on what "
          "users post to the train route, and serving never stops. ") * 8


def load(url: str, streams: int, seconds: float) -> dict:
    """Closed loop: each client streams request after request until time is up."""
    tokens = [0] * streams
    stop_at = time.monotonic() + seconds

    def client(i: int) -> None:
        with httpx.Client(base_url=url, timeout=600) as c:
            while time.monotonic() < stop_at:
                body = {"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "max_tokens": 64,
                        "temperature": 0, "stream": True}
                with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                            tokens[i] += 1

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    return {"tokens": sum(tokens), "seconds": wall, "tok_s": sum(tokens) / wall}


def run_mode(http: httpx.Client, url: str, pacing: dict | None, streams: int, seconds: float) -> dict:
    jid = None
    if pacing is not None:
        r = http.post("/train", json={"text": LESSON, "window": 64, "chunk": 32, "epochs": 1000, "promote": "never",
                                      **pacing})
        r.raise_for_status()
        jid = r.json()["id"]
        while http.get(f"/train/{jid}").json()["progress"]["step"] < 1:   # trainer built, first step taken
            time.sleep(0.1)
    client = load(url, streams, seconds)
    out = {"pacing": pacing, "client": client}
    if jid is not None:
        time.sleep(1.1)                                                     # the figures are flushed every second
        job = http.get(f"/train/{jid}").json()
        out["pacer"] = job["pacing"]
        out["job"] = {"steps": job["progress"]["step"], "train_tok_s": job["progress"]["train_tok_s"],
                      "memory": job["memory"]}
        http.post(f"/train/{jid}/cancel")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as state:
        settings = ServerSettings(ctx=2048, parallel=args.streams, threads=args.threads, state_dir=state)
        with BackgroundServer(settings) as srv, httpx.Client(base_url=srv.url, timeout=600) as http:
            load(srv.url, args.streams, 3.0)                                # warm-up
            modes = {"no_job": run_mode(http, srv.url, None, args.streams, args.seconds),
                     "max_slowdown_0.10": run_mode(http, srv.url, {"max_slowdown": 0.10}, args.streams, args.seconds),
                     "share_0.25": run_mode(http, srv.url, {"share": 0.25}, args.streams, args.seconds)}
    base = modes["no_job"]["client"]["tok_s"]
    for m in modes.values():
        m["client"]["slowdown_vs_no_job"] = 1.0 - m["client"]["tok_s"] / base
    result = {"date": dt.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "load_average_at_end": os.getloadavg(), "streams": args.streams, "seconds": args.seconds,
              "threads": args.threads, "modes": modes}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"dream-pacing-{result['date']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    for name, m in modes.items():
        p = m.get("pacer") or {}
        print(f"{name:18s} client {m['client']['tok_s']:6.1f} tok/s ({m['client']['slowdown_vs_no_job']:+.1%})  "
              f"pacer slowdown {p.get('realized_slowdown')}  step ms p50 {p.get('micro_step_ms_p50')} "
              f"p95 {p.get('micro_step_ms_p95')} max {p.get('micro_step_ms_max')}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
