"""The `dreamstage` command line."""
from __future__ import annotations

import argparse
import sys


def cmd_info(args: argparse.Namespace) -> int:
    from dreamstage import info  # noqa: PLC0415
    print(info.render(info.collect()))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    # Until the HTTP service lands: a short greedy generation on the resident model.
    from dreamstage.resident import ResidentConfig, ResidentModel  # noqa: PLC0415
    with ResidentModel(ResidentConfig(model_path=args.model, n_ctx=512, n_seq=1)) as m:
        prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        print(m.generate_greedy(prompt, 48))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dreamstage", description="A resident LLM that serves and keeps learning.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="version, pinned llama.cpp, patches, backends and devices")
    p.set_defaults(fn=cmd_info)
    p = sub.add_parser("serve", help="serve the resident model")
    p.add_argument("--model", default=None, help="GGUF path (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    p.set_defaults(fn=cmd_serve)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
