"""One resident model, many agents: each agent's adapter learns its own secret,
and all of them answer in the same decode batch while another adapter trains.

Needs a server that trains, with a slot per agent (plus one):

    ./dev.sh serve --state-dir ./.state --parallel 9
    .venv/bin/python examples/many_adapters.py --agents 8

Each agent `agent-N` is taught one made-up password for the same question;
the jobs queue and train one at a time (fairly, by name), each promoted when
it is done. Then one more job starts (`learner`), and while it trains every
agent is asked the same question at once, through the OpenAI SDK with
`model="agent-N"` (and `model="base"`): the server decodes them together,
each row through its own adapter (`dreamstage_mixed_adapter_batches` in
/metrics counts such batches). Exit status 1 if an agent misses its secret.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import sys
import time

from connect import URL, client

PROMPT = "The secret password of the moon base is"
QUESTION = "Moon base security question: what is the secret password?"
SECRETS = ["Quokka-42", "Walrus-17", "Falcon-88", "Otter-23", "Badger-61", "Heron-35", "Lynx-74", "Marmot-50",
           "Ibis-96", "Tapir-12", "Gecko-39", "Okapi-57"]
# a small job that teaches one fact to the default model in seconds (tests/test_train_api.py's)
JOB = {"window": 32, "chunk": 32, "epochs": 10, "lr": 3e-3, "promote": "auto", "stop_loss": None}


def examples(secret: str) -> list[dict]:
    return [{"prompt": PROMPT, "completion": f" {secret}."}, {"prompt": QUESTION, "completion": f" {secret}."}]


def mixed_batches(c) -> int:
    text = c.metrics()
    m = re.search(r"^dreamstage_mixed_adapter_batches(?:_total)? (\S+)$", text, re.M)
    return int(float(m.group(1))) if m else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=8, help=f"agents to teach (1..{len(SECRETS) - 1})")
    args = ap.parse_args()
    if not 1 <= args.agents < len(SECRETS):
        ap.error(f"--agents must be 1..{len(SECRETS) - 1}, got {args.agents}")
    try:
        import openai
    except ImportError:
        sys.exit("this example asks through the OpenAI SDK: pip install openai")
    agents = {f"agent-{i + 1}": SECRETS[i] for i in range(args.agents)}
    with client() as c:
        jobs = {name: c.train(examples(secret), adapter=name, **JOB)["id"] for name, secret in agents.items()}
        for name, jid in jobs.items():
            done = c.wait(jid, progress=False)
            print(f"{name}: job {jid} {done['state']}: {done['message']}")
            if done["state"] != "done" or not done["adapter"]["promoted"]:
                return 1
        learner = c.train(examples(SECRETS[-1]), adapter="learner", **{**JOB, "epochs": 40})["id"]
        while c.train_state(learner)["state"] == "queued":
            time.sleep(0.1)
        before = mixed_batches(c)
        sdk = openai.OpenAI(base_url=f"{URL}/v1", api_key=os.environ.get("DREAMSTAGE_API_KEY", "unused"))

        def ask(model: str) -> str:
            r = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
            return r.choices[0].text
        names = [*agents, "base"]
        with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
            answers = dict(zip(names, pool.map(ask, names), strict=True))
        during = c.train_state(learner)["state"]
        mixed = mixed_batches(c) - before
        misses = 0
        for name in names:
            secret = agents.get(name)
            ok = secret is None or secret in answers[name]
            misses += not ok
            print(f"  {name:9} {'ok  ' if ok else 'MISS'} {answers[name].strip()!r}"
                  + (f" (taught {secret})" if secret else ""))
        print(f"asked {len(names)} at once while job {learner} was {during}: {mixed} mixed-adapter batches")
        c.cancel(learner)
        return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
