"""Export the served adapter and load it in llama-cpp-python: the same answers.

Run after teach_facts.py (something must be promoted), on the machine that
runs the server (the adapter file lives in its state directory):

    .venv/bin/python examples/export_adapter.py --state-dir ./.state --out moonbase.gguf

The served adapter is an ordinary GGUF LoRA file, written atomically when
the job finished. The script copies it to --out, then loads the base model
with that LoRA through llama-cpp-python's own `Llama(model_path=...,
lora_path=...)` (running on dreamstage's libllama build; no dreamstage code
touches the weights) and asks the questions of teach_facts.py greedily on
both sides. Exit status 1 if any answer differs.

With a stock llama.cpp build the same file loads with
`llama-cli -m MODEL.gguf --lora moonbase.gguf`.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from connect import client
from teach_facts import QUESTIONS

MAX_TOKENS = 24


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="moonbase.gguf", help="where to copy the served adapter")
    ap.add_argument("--model", default=None, help="the GGUF the server runs (default: the embedded default model)")
    ap.add_argument("--state-dir", default=None,
                    help="the server's --state-dir (default: the server's default, ~/.local/share/dreamstage)")
    args = ap.parse_args()

    with client() as c:
        served = c.adapters()["served"]
        if served is None:
            print("nothing is promoted: run examples/teach_facts.py first", file=sys.stderr)
            return 2
        src = Path(served["path"])
        if not src.is_absolute():                      # the server may report it relative to its state directory
            from dreamstage.training.jobs.store import default_state_dir
            src = Path(args.state_dir or default_state_dir()) / src
        shutil.copyfile(src, args.out)
        print(f"exported {served['name']} v{served['version']} -> {args.out} ({Path(args.out).stat().st_size} bytes)")
        server = {q: c.chat([{"role": "user", "content": q}], max_tokens=MAX_TOKENS, temperature=0) for q in QUESTIONS}

    # imported late: only this half needs the native library
    from dreamstage import default_model as models
    from dreamstage import native

    llama_cpp = native.llama_cpp()
    model = args.model or str(models.default_model())
    llm = llama_cpp.Llama(model_path=model, lora_path=args.out, n_ctx=512, verbose=False)
    differ = 0
    for q in QUESTIONS:
        theirs = llm.create_chat_completion(messages=[{"role": "user", "content": q}], max_tokens=MAX_TOKENS,
                                            temperature=0)["choices"][0]["message"]["content"]
        ours = server[q].text
        same = ours.strip() == theirs.strip()
        differ += not same
        print(f"{'same' if same else 'DIFFERENT'}: {q}"
              f"\n  dreamstage (adapter v{server[q].adapter_version}): {ours.strip()}"
              f"\n  llama_cpp.Llama(lora_path=...):  {theirs.strip()}")
    print("all answers equal" if not differ else f"{differ} of {len(QUESTIONS)} answers differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
