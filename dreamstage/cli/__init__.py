"""The `dreamstage` command line: one module per command (serve, train and status,
adapters, feedback, rpc-worker); this one builds the parser and runs a command."""
from __future__ import annotations

import argparse
import os
import sys

from dreamstage.cli.adapters import add_adapters
from dreamstage.cli.feedback import add_feedback
from dreamstage.cli.rpc_worker import add_rpc_worker
from dreamstage.cli.serve import add_serve, serve_settings
from dreamstage.cli.train import add_train, render_status

__all__ = ["build_parser", "main", "render_status", "serve_settings"]


def cmd_info(args: argparse.Namespace) -> int:
    from dreamstage import info
    print(info.render(info.collect()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dreamstage", description="A resident LLM that serves and keeps learning.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="version, pinned llama.cpp, patches, backends and devices")
    p.set_defaults(fn=cmd_info)
    add_serve(sub)
    add_train(sub)
    add_adapters(sub)
    add_feedback(sub)
    add_rpc_worker(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        rc = args.fn(args)
        sys.stdout.flush()                           # a closed pipe shows here, not at exit
        return rc
    except KeyboardInterrupt:
        print(f"dreamstage {args.cmd}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`dreamstage info | head`): stop quietly, as a pipe's writer does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:  # one line for the user; DREAMSTAGE_DEBUG=1 shows the traceback
        from dreamstage import environment

        if environment.flag("DREAMSTAGE_DEBUG"):
            raise
        print(f"dreamstage {args.cmd}: {type(e).__name__}: {e} (DREAMSTAGE_DEBUG=1 shows where)", file=sys.stderr)
        return 1
