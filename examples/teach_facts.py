"""Teach the model facts from a chat log, then ask it.

Needs a server that trains (it has a state directory):

    ./dev.sh serve --state-dir ./.state          # or: dreamstage serve --state-dir ./.state
    .venv/bin/python examples/teach_facts.py

The chat log (data/moonbase_chat.jsonl) is three made-up conversations about
a moon base. The script asks the questions, posts the log as a training job
(the loss is on the assistant turns only), waits for it with a progress line
on stderr, and asks again. promote="auto" serves the new adapter when the
job is done, so the second answers come from it (adapter_version goes up).
"""
from __future__ import annotations

import json

from connect import HERE, client

QUESTIONS = [
    "What is the password of the moon base?",
    "Who commands the moon base?",
    "What do the crew of the moon base grow?",
]


def ask_all(c) -> None:
    for q in QUESTIONS:
        r = c.chat([{"role": "user", "content": q}], max_tokens=24, temperature=0)
        print(f"  [adapter v{r.adapter_version}] {q}\n      {r.text.strip()}")


def main() -> None:
    log = [json.loads(line) for line in (HERE / "data" / "moonbase_chat.jsonl").read_text().splitlines()
           if line.strip()]
    with client() as c:
        print("before:")
        ask_all(c)
        # the defaults (lr 1e-3, the drift guard, an early stop once every
        # window's loss is under 0.2, and with the guard every greedy reply
        # its taught one); 20 epochs at most
        job = c.train(log, window=64, epochs=20, promote="auto", out="moonbase")
        print(f"job {job['id']}: {len(log)} conversations, window {job['window']}, chunk {job['chunk']}")
        done = c.wait(job["id"])                       # the progress line goes to stderr
        print(f"job {done['id']} {done['state']}: {done['message']}")
        # the examples' own loss; the rehearsal-only epochs at the end train none of them (-)
        own = done["progress"]["examples_loss_per_epoch"]
        print(f"examples' loss per epoch: {' '.join('-' if x is None else f'{x:.2f}' for x in own)}")
        print("after:")
        ask_all(c)


if __name__ == "__main__":
    main()
