"""`dreamstage rpc-worker`: a llama.cpp RPC worker that holds layers for `serve --rpc`."""
from __future__ import annotations

import argparse
import os
import sys


def cmd_rpc_worker(args: argparse.Namespace) -> int:
    """Replace this process with dreamstage-rpc-server (so a signal reaches the worker itself)."""
    from dreamstage.server.security import is_loopback
    from dreamstage.serving import rpc

    if not is_loopback(args.host):
        if not args.rpc_allow_remote:
            print(f"dreamstage rpc-worker: refusing to bind {args.host}, which is not a loopback address: RPC has "
                  "no authentication or encryption; pass --rpc-allow-remote only on a network you trust",
                  file=sys.stderr)
            return 2
        print(f"dreamstage rpc-worker: WARNING: anyone who reaches {args.host}:{args.port} can read and write this "
              "worker's memory and run graphs on it; keep the port on a trusted network (docs/architecture/rpc.md)",
              file=sys.stderr)
    prog = str(rpc.worker_program())
    argv = [prog, "--host", args.host, "--port", str(args.port)]
    if args.device:
        argv += ["--device", args.device]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    sys.stdout.flush()
    os.execv(prog, argv)
    return 0    # not reached


def add_rpc_worker(sub) -> None:
    from dreamstage.serving import rpc

    p = sub.add_parser("rpc-worker", help="run an RPC worker that holds layers for `serve --rpc` (loopback by "
                                          "default)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=rpc.DEFAULT_WORKER_PORT,
                   help=f"(default {rpc.DEFAULT_WORKER_PORT})")
    p.add_argument("--device", default=None, metavar="D[,D...]",
                   help="ggml devices to serve (default: every GPU, else the CPU)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: half the cores)")
    p.add_argument("--rpc-allow-remote", action="store_true",
                   help="bind a non-loopback address (no authentication: a trusted network only)")
    p.set_defaults(fn=cmd_rpc_worker)
