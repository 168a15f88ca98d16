"""The README's one-fact job over HTTP with the drift guard on, as a user runs it.

    nice python bench/bench_readme_job.py --jobs 0.003:0:off,0.003:0,0.001:0,0.001:1 \
        --out bench/results/readme-job-2026-12-02.json

One server (the default model, one thread, the guard on, a fresh state
directory), the README's example (`{"prompt": "The secret password of the moon
base is", "completion": " Quokka-42."}`, window 32, 10 epochs, promote auto)
posted once per `--jobs` entry (lr:seed, and :off for the regularizer off,
as every job with a window under about 60 tokens trained before the trainer's
window made room for the rehearsal), one job after the other. The first job records the base's
anchors and measures the noise margin (cached for the later jobs), so its wall
time includes them; the others' is training and measuring only. Per job: the
wall time from the POST to its final state, the answer at temperature 0 after
it, its final drift figures and its message. docs/benchmarks.md ("Drift guard:
anchors changed, drift_kl, recall") quotes it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
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
# --chat: the same fact as a chat turn (is a job's drift its fact's or its format's?)
QUESTION = "What is the secret password of the moon base?"
REPLY = PROMPT + ANSWER


def example(chat: bool) -> dict:
    if chat:
        return {"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": REPLY}]}
    return {"prompt": PROMPT, "completion": ANSWER}


def answer(http: httpx.Client, chat: bool) -> str:
    if chat:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": QUESTION}],
                                                    "max_tokens": 24, "temperature": 0})
        r.raise_for_status()
        return r.json()["choices"][0]["message"]["content"]
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def run(jobs: list[tuple[float, int, bool]], threads: int, fields: dict | None = None,
        chat: bool = False) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as state:
        settings = ServerSettings(ctx=1024, parallel=2, threads=threads, state_dir=state, drift_guard=True)
        with BackgroundServer(settings) as srv, httpx.Client(base_url=srv.url, timeout=900) as http:
            for i, (lr, seed, regularizer) in enumerate(jobs):
                t0 = time.monotonic()
                r = http.post("/train", json={"examples": [example(chat)], "window": 128 if chat else 32,
                                              "epochs": 10, "lr": lr, "seed": seed, "regularizer": regularizer,
                                              "promote": "auto", "out": f"moon{i}", **(fields or {})})
                r.raise_for_status()
                jid = r.json()["id"]
                while (job := http.get(f"/train/{jid}").json())["state"] not in TERMINAL:
                    time.sleep(0.5)
                wall = time.monotonic() - t0
                text = answer(http, chat)
                d = job["progress"].get("drift") or {}
                row = {"lr": lr, "seed": seed, "regularizer": regularizer, "fields": fields or {}, "chat": chat,
                       "first": i == 0,
                       "wall_s": round(wall, 1), "state": job["state"],
                       "promoted": bool((job.get("adapter") or {}).get("promoted")), "answer": text,
                       "recalled": ANSWER.strip() in text, "epochs": job["progress"].get("epoch"),
                       **{k: d.get(k) for k in ("drift_kl", "anchors_changed_count", "anchors_changed_raw_count",
                                                "noise_margin", "anchors", "noise_draws", "changed_anchors")},
                       "message": job["message"]}
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", default="0.003:0:off,0.003:0,0.001:0,0.001:1",
                    help="comma-separated lr:seed[:off], one job each, in this order")
    ap.add_argument("--set", default="{}", help="more job fields as a JSON object")
    ap.add_argument("--chat", action="store_true",
                    help="post the fact as a chat turn (window 128) and ask it as one")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    try:
        fields = json.loads(args.set)
    except ValueError as e:
        sys.exit(f"--set must be a JSON object: {e}")
    if not isinstance(fields, dict):
        sys.exit(f"--set must be a JSON object, got {args.set!r}")
    jobs = []
    for item in args.jobs.split(","):
        parts = item.split(":")
        try:
            if not 2 <= len(parts) <= 3 or parts[2:] not in ([], ["off"]):
                raise ValueError(item)
            jobs.append((float(parts[0]), int(parts[1]), parts[2:] != ["off"]))
        except ValueError:
            sys.exit(f"--jobs: each entry is lr:seed or lr:seed:off, got {item!r}")
    load = os.getloadavg()
    rows = run(jobs, args.threads, fields, args.chat)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": describe(), "threads": args.threads,
            "chat": args.chat, "fields": fields, "load_avg_start": load, "load_avg_end": os.getloadavg(),
            "jobs": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
