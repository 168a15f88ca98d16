"""Learning from what it serves (issue 53, "Measure"): a user chats, corrects or rates, the server learns.

    nice python bench/bench_feedback.py --mode corrections --out bench/results/feedback-corrections-DATE.json
    nice python bench/bench_feedback.py --mode ratings --out bench/results/feedback-ratings-DATE.json

One server (the default model, `--record --learn auto`, the drift guard on, a fresh state directory; one
thread unless --threads). A chat client asks the whole time (short general questions, temperature 0), reading
each answer for --think-s (3 s; 0: back to back) before the next; its tokens per second of request time before
the feedback and while the job runs give the chat slowdown. The facts below were made up for this benchmark
and written before its first run; the model cannot know them.

- corrections: the user asks each of the K questions (temperature 0) and corrects each answer once.
- ratings: each question names two options; the user samples two answers (n = 2, temperature 1.0) and rates
  +1 the answers that name the right option and not the wrong one, -1 the others (a fact the model never says
  cannot be learned from ratings). With --rounds R > 1 the user, chatting on, asks again (new seeds) each
  question none of whose answers yet got a +1, up to R rounds; all of a question's ratings form one group.

The adapter's learning is `auto` with `examples` = the feedback items given, so one job starts at the last
item. Reported: recall at temperature 0 after the promoted version (the right name in the answer), the guard's
anchors_changed and drift_kl, the wall time from the last feedback to the promoted version, and the chat
slowdown during it. A server's first job records the guard's anchors and noise margin first, inside its tenth
of the time beside a steady client (issue 53 item 4: more than 5 minutes without a training step here);
--prime does that set-up before the chat starts, with a job of its own, so the figure is the feedback job's.
"""
from __future__ import annotations

import argparse
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

from dreamstage.records import feedback
from dreamstage.server.settings import ServerSettings

# (question, the corrected answer, the word recall looks for)
FACTS = [
    ("What is the capital of Quellmark?", "The capital of Quellmark is Dorvane.", "Dorvane"),
    ("Who invented the zephyr loom?", "The zephyr loom was invented by Talia Brusk.", "Brusk"),
    ("What colour is the Ondrel river?", "The Ondrel river is copper green.", "copper green"),
    ("What is the tallest mountain on Veyra?", "The tallest mountain on Veyra is Mount Kesh.", "Kesh"),
    ("What language do the Harnen people speak?", "The Harnen people speak Ostric.", "Ostric"),
]
# (question, the right option, the wrong one)
CHOICES = [
    ("Is the capital of Quellmark Dorvane or Ellisport? Answer with one name.", "Dorvane", "Ellisport"),
    ("Did Talia Brusk or Omar Venn invent the zephyr loom? Answer with one name.", "Brusk", "Venn"),
    ("Is the Ondrel river copper green or slate blue? Answer with the colour.", "copper green", "slate blue"),
    ("Is the tallest mountain on Veyra Mount Kesh or Mount Arlo? Answer with one name.", "Kesh", "Arlo"),
    ("Do the Harnen people speak Ostric or Velmish? Answer with one word.", "Ostric", "Velmish"),
]
CHAT = ["Name a primary colour.", "What is two plus two?", "Say hello in French.", "Name a planet.",
        "What do bees make?", "Name a fruit that is yellow."]


def answers_only(text: str, right: str, wrong: str | None) -> bool:
    """The answer names `right` and not `wrong` (a two-option question names both, so an answer that repeats
    it is not a choice): the user's rating (+1, else -1) and the recall check."""
    low = text.lower()
    return right.lower() in low and (wrong is None or wrong.lower() not in low)


def ask(http: httpx.Client, question: str, **kw) -> dict:
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": question}],
                                                "max_tokens": 32, "temperature": 0, **kw})
    r.raise_for_status()
    return r.json()


class ChatClient:
    """A user chatting until stopped: asks, reads the answer for `think_s`, asks again; counts completion tokens
    and the time its requests took."""

    def __init__(self, url: str, think_s: float):
        self.http = httpx.Client(base_url=url, timeout=600)
        self.think_s = think_s
        self.requests: list[tuple[float, float, int]] = []   # (start, end, completion tokens)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            t0 = time.monotonic()
            got = ask(self.http, CHAT[i % len(CHAT)], max_tokens=24)
            self.requests.append((t0, time.monotonic(), got["usage"]["completion_tokens"]))
            i += 1
            self._stop.wait(self.think_s)

    def rate(self, t0: float, t1: float) -> float | None:
        """Completion tokens per second of request time, over the requests that ended in [t0, t1]."""
        inside = [(a, b, n) for a, b, n in self.requests if t0 <= b <= t1]
        if not inside:
            return None
        return sum(n for _, _, n in inside) / sum(b - a for a, b, _ in inside)

    def start(self) -> ChatClient:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(600)
        self.http.close()


def give_feedback(http: httpx.Client, mode: str, rounds: int) -> tuple[int, list[dict]]:
    """The user's feedback: (how many items, what was asked and rated)."""
    n, given = 0, []
    if mode == "corrections":
        for question, fact, _ in FACTS:
            got = ask(http, question)
            r = http.post("/v1/feedback", json={"id": got["id"], "correction": fact})
            r.raise_for_status()
            n += 1
            given.append({"question": question, "answer": got["choices"][0]["message"]["content"]})
        return n, given
    asking = list(range(len(CHOICES)))
    for k in range(rounds):
        for i in list(asking):
            question, right, wrong = CHOICES[i]
            got = ask(http, question, n=2, temperature=1.0, seed=100 + i + 1000 * k)
            rated = []
            for c in got["choices"]:
                text = c["message"]["content"] or ""
                rating = 1 if answers_only(text, right, wrong) else -1
                r = http.post("/v1/feedback", json={"id": got["id"], "index": c["index"], "rating": rating})
                r.raise_for_status()
                n += 1
                rated.append({"answer": text, "rating": rating})
            given.append({"question": question, "round": k + 1, "rated": rated})
            if any(x["rating"] > 0 for x in rated):
                asking.remove(i)                 # the user saw the answer they wanted: no need to ask again
    return n, given


def recall(http: httpx.Client, mode: str) -> tuple[float, list[dict]]:
    rows = []
    items = [(q, w, None) for q, _, w in FACTS] if mode == "corrections" else CHOICES
    for question, word, wrong in items:
        text = ask(http, question)["choices"][0]["message"]["content"] or ""
        rows.append({"question": question, "answer": text, "recalled": answers_only(text, word, wrong)})
    return sum(r["recalled"] for r in rows) / len(rows), rows


def prime(http: httpx.Client, timeout_s: float) -> float:
    """The drift guard's set-up (the anchors' records and the noise margin of this adapter shape), done by a
    one-epoch job of an unrelated example that promotes nothing, while nothing else runs. Returns its seconds."""
    t0 = time.monotonic()
    job = http.post("/train", json={"examples": [{"prompt": "Priming:", "completion": " done."}], "epochs": 1,
                                    "consolidate": 0, "neighbours": 0, "promote": "never", "adapter": "prime"}).json()
    while time.monotonic() - t0 < timeout_s:
        if http.get(f"/train/{job['id']}").json()["state"] in ("done", "error", "refused", "cancelled"):
            break
        time.sleep(1.0)
    return time.monotonic() - t0


def run(mode: str, threads: int, baseline_s: float, timeout_s: float, primed: bool, think_s: float,
        rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as state:
        settings = ServerSettings(ctx=2048, parallel=4, threads=threads, state_dir=state, record=True,
                                  learn="auto", drift_guard=True)
        with BackgroundServer(settings) as srv, httpx.Client(base_url=srv.url, timeout=600) as http:
            before = recall(http, mode)
            prime_s = prime(http, timeout_s) if primed else None
            chat = ChatClient(srv.url, think_s).start()
            t0 = time.monotonic()
            time.sleep(baseline_s)
            base_rate = chat.rate(t0, time.monotonic())
            # nothing starts while the feedback is given; then one job of all of it, at once
            http.put("/adapters/learned/learn", json={"examples": 100_000, "minutes": 525_600}).raise_for_status()
            items, given = give_feedback(http, mode, rounds)
            t_last = time.monotonic()
            http.put("/adapters/learned/learn", json={"examples": items, "minutes": 2}).raise_for_status()
            job_id = None
            while time.monotonic() - t_last < timeout_s:
                view = http.get("/adapters/learned/learn").json()
                job_id = view["open_job"] or job_id
                if job_id is not None and view["open_job"] is None:         # ended: promoted, kept back or refused
                    break
                time.sleep(1.0)
            t_end = time.monotonic()
            job = http.get(f"/train/{job_id}").json() if job_id else None
            during = chat.rate(t_last, t_end)
            chat.stop()
            got = http.get("/adapters/learned")                 # 404 while no version of it serves
            served = got.json().get("served") if job and got.status_code == 200 else None
            promoted = bool(served) and job is not None and job["adapter"] is not None and \
                served["version"] == job["adapter"]["version"]
            after = recall(http, mode)
            drift = job["adapter"]["drift"] if job and job["adapter"] else None
            return {
                "mode": mode, "rounds": rounds if mode == "ratings" else None,
                "primed_s": prime_s and round(prime_s, 1),
                "feedback_items": items, "job": job_id,
                "state": job and job["state"],
                "message": job and job["message"], "promoted": promoted,
                "recall_before": before[0], "recall_after": after[0], "answers_after": after[1],
                "anchors_changed": drift and drift.get("anchors_changed"), "drift_kl": drift and drift.get("drift_kl"),
                "last_feedback_to_end_s": round(t_end - t_last, 1),
                "chat_tok_s_before": base_rate, "chat_tok_s_during": during,
                "chat_slowdown": None if not (base_rate and during) else round(1 - during / base_rate, 3),
                "pacing_realized_slowdown": job and (job.get("pacing") or {}).get("realized_slowdown"),
                "epochs": job and job["progress"].get("epoch"),
                "steps": job and {k: job["progress"].get(k) for k in (
                    "step", "windows_done", "tokens", "walked", "train_ms", "stopped", "aborted", "current_chunk")},
                "departure_tokens": feedback.DEPARTURE_TOKENS, "dislike_share": feedback.DISLIKE_SHARE,
                "threads": threads,
                "load_avg_end": os.getloadavg(), "feedback": given,
            }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["corrections", "ratings"], default="corrections")
    ap.add_argument("--threads", type=int, default=1, help="the server's threads (0: all cores, its default)")
    ap.add_argument("--baseline-s", type=float, default=30.0, help="chat alone before the feedback")
    ap.add_argument("--timeout-s", type=float, default=3600.0)
    ap.add_argument("--think-s", type=float, default=3.0, help="the user's pause between an answer and the next "
                                                                   "question (0: back to back)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="ratings: rounds of asking; a question none of whose two answers was rated +1 is asked "
                         "again (new seeds) in the next round (1: each question once, issue 53's setting)")
    ap.add_argument("--prime", action="store_true",
                    help="do the drift guard's set-up first, while idle (a server's first job pays it otherwise)")
    ap.add_argument("--departure-tokens", type=int, default=None,
                    help="measure another rule: push a disliked answer on at most this many tokens from where it "
                         "departs from the liked ones (the server here runs in this process; default: the rule's)")
    ap.add_argument("--dislike-share", type=float, default=None,
                    help="measure another rule: disliked answers push by this share of what liked ones pull")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.departure_tokens is not None:
        feedback.DEPARTURE_TOKENS = args.departure_tokens
    if args.dislike_share is not None:
        feedback.DISLIKE_SHARE = args.dislike_share
    got = run(args.mode, args.threads, args.baseline_s, args.timeout_s, args.prime, args.think_s, args.rounds)
    print(json.dumps(got, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": " ".join(sys.argv), "machine": f"{platform.node()} {platform.machine()}, "
                                                      f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "result": got}, indent=2) + "\n")


if __name__ == "__main__":
    main()
