"""Made-up facts taught by a real job over HTTP, every default on, as a user posts it.

    nice python bench/bench_drift_job.py --seeds 3,4 --out bench/results/drift-job-....json
    nice python bench/bench_drift_job.py --facts tests --seeds 0 --set '{"neighbours": 0}'

bench_drift.py trains its settings with its own loop (no pacing, no example
hold, some settings emulated); this one runs the job the server runs: one
server (the default model, one thread, the drift guard on, a fresh state
directory), one POST /train per seed with the facts as chat examples,
`promote: auto` and nothing else but `--set` (a JSON object of job fields),
one job after the other. The first job records the base's anchors and
measures the noise margin (cached for the later ones), so its wall time
includes them. Per job: its state, whether it was promoted, its final drift
figures and the changed anchors' count, its message, and recall: each fact's
question asked at temperature 0 (/v1/chat/completions, 24 tokens) with the
job's adapter served (promoted by hand first when auto promotion refused it),
counted when the answer holds the fact's key word.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_drift import tests_facts
from drift_facts import EVAL_FACTS, FRESH_FACTS, chat_examples

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))   # background_server

from background_server import BackgroundServer
from machine import describe

from dreamstage.server.settings import ServerSettings
from dreamstage.training.jobs.store import TERMINAL


def ask(http: httpx.Client, question: str) -> str:
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": question}],
                                                "max_tokens": 24, "temperature": 0})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def run(facts, seeds: list[int], fields: dict, threads: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as state:
        settings = ServerSettings(ctx=1024, parallel=2, threads=threads, state_dir=state, drift_guard=True)
        with BackgroundServer(settings) as srv, httpx.Client(base_url=srv.url, timeout=900) as http:
            base = [ask(http, q) for q, _, _ in facts]
            for i, seed in enumerate(seeds):
                t0 = time.monotonic()
                r = http.post("/train", json={"examples": chat_examples(facts), "seed": seed, "promote": "auto",
                                              "out": f"facts{i}", **fields})
                if r.status_code != 202:
                    sys.exit(f"POST /train answered {r.status_code}: {r.text}")
                jid = r.json()["id"]
                while (job := http.get(f"/train/{jid}").json())["state"] not in TERMINAL:
                    time.sleep(1.0)
                wall = time.monotonic() - t0
                adapter = job.get("adapter") or {}
                promoted = bool(adapter.get("promoted"))
                if not promoted and adapter.get("name"):
                    http.post(f"/adapters/{adapter['name']}/promote").raise_for_status()
                answers = [ask(http, q) for q, _, _ in facts]
                hits = [key.lower() in a.lower() for a, (_, _, key) in zip(answers, facts, strict=True)]
                d = job["progress"].get("drift") or {}
                row = {"seed": seed, "fields": fields, "first": i == 0, "wall_s": round(wall, 1),
                       "state": job["state"], "promoted": promoted, "recall": sum(hits) / len(hits),
                       "epochs": job["progress"].get("epoch"),
                       **{k: d.get(k) for k in ("drift_kl", "anchors_changed", "anchors_changed_count",
                                                "anchors_changed_raw_count", "noise_margin", "anchors",
                                                "noise_draws", "changed_anchors")},
                       "message": job["message"], "answers": answers, "base_answers": base}
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--facts", choices=("eval", "tests", "fresh"), default="eval")
    ap.add_argument("--seeds", default="3", help="comma-separated job seeds, one job each, in this order")
    ap.add_argument("--first", type=int, default=None, help="teach only the set's first N facts")
    ap.add_argument("--set", default="{}", help="job fields as a JSON object, on top of the defaults")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    try:
        fields = json.loads(args.set)
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError as e:
        sys.exit(f"--set must be a JSON object and --seeds integers: {e}")
    if not isinstance(fields, dict):
        sys.exit(f"--set must be a JSON object, got {args.set!r}")
    facts = ({"eval": EVAL_FACTS, "fresh": FRESH_FACTS}.get(args.facts) or tests_facts())[:args.first]
    if not facts:
        sys.exit(f"--first {args.first} leaves no fact to teach")
    load = os.getloadavg()
    rows = run(facts, seeds, fields, args.threads)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": describe(), "threads": args.threads,
            "facts": args.facts, "first": args.first, "load_avg_start": load, "load_avg_end": os.getloadavg(),
            "jobs": rows},
            indent=1) + "\n")


if __name__ == "__main__":
    main()
