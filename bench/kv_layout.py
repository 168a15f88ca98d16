"""Does a request's greedy answer depend on its neighbours? One K/V stream per slot against one pool.

For each layout (serve's default of one stream per slot, and --kv-unified's
pool) the default model answers 4 chat prompts greedily: one at a time on a
fresh context, all 4 submitted at once, the 4 staggered (one every
--stagger-ms), and one at a time again on the cache they left. Each answer is
compared with the per-slot streams' one-at-a-time answer. The figures back
the choice of default in docs/architecture/serving.md ("K/V layout").

    python bench/kv_layout.py --ctx 1024 --threads 1 [--flash-attn auto|on|off]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import threading
import time
from pathlib import Path

from dreamstage.serving.engine import Delta, Engine, Failed, Finished, GenerationRequest
from dreamstage.serving.resident import ResidentConfig, ResidentModel
from dreamstage.serving.sampling import SamplingParams

# a chat as the default model's GGUF template renders it (its default system turn included)
CHAT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
PROMPTS = ["What is the capital of France?", "Write a haiku about snow.", "List three fruits.",
           "Why is the sky blue?"]
GREEDY = SamplingParams(temperature=0.0)


def answers(engine: Engine, tokens: int, stagger_s: float | None) -> list[str]:
    """The answers to PROMPTS: one at a time (stagger_s None), else submitted stagger_s apart."""
    def submit(p):
        got: list = []
        done = threading.Event()

        def sink(ev):
            got.append(ev)
            if isinstance(ev, (Finished, Failed)):
                done.set()
        engine.submit(GenerationRequest(CHAT.format(p), tokens, GREEDY), sink)
        return got, done

    def text(pending):
        got, done = pending
        if not done.wait(600) or isinstance(got[-1], Failed):
            raise RuntimeError(f"no answer: {got[-1:]}")
        return "".join(ev.text for ev in got if isinstance(ev, Delta))

    if stagger_s is None:
        return [text(submit(p)) for p in PROMPTS]
    pending = []
    for p in PROMPTS:
        pending.append(submit(p))
        time.sleep(stagger_s)
    return [text(x) for x in pending]


def layout(unified: bool, args) -> dict[str, list[str]]:
    model = ResidentModel(ResidentConfig(n_ctx=args.ctx * (1 if unified else len(PROMPTS)), n_seq=len(PROMPTS),
                                         n_threads=args.threads, kv_unified=unified, flash_attn=args.flash_attn))
    engine = Engine(model).start()
    try:
        return {"alone": answers(engine, args.tokens, None), "together": answers(engine, args.tokens, 0.0),
                "staggered": answers(engine, args.tokens, args.stagger_ms / 1000),
                "again": answers(engine, args.tokens, None)}
    finally:
        engine.stop()
        model.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, default=1024, help="each request's context: a slot's stream, or the pool")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--stagger-ms", type=float, default=50.0)
    ap.add_argument("--flash-attn", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    streams, pool = layout(False, args), layout(True, args)
    ref = streams["alone"]
    same = {f"{name}/{case}": [a == b for a, b in zip(got, ref, strict=True)]
            for name, runs in (("streams", streams), ("pool", pool)) for case, got in runs.items()}
    result = {"date": dt.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "same_as_streams_alone": same, "answers": {"streams": streams, "pool": pool}}
    for key, flags in same.items():
        print(f"{key:<18} {sum(flags)}/{len(flags)} equal")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
