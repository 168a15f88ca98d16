"""The `dreamstage` command line."""
from __future__ import annotations

import argparse
import sys


def cmd_info(args: argparse.Namespace) -> int:
    from dreamstage import info  # noqa: PLC0415
    print(info.render(info.collect()))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn  # noqa: PLC0415

    from dreamstage.server.app import create_app  # noqa: PLC0415
    from dreamstage.server.service import Service  # noqa: PLC0415
    from dreamstage.server.settings import ServerSettings  # noqa: PLC0415

    settings = ServerSettings(model=args.model, host=args.host, port=args.port, parallel=args.parallel,
                              ctx=args.ctx, batch=args.batch, threads=args.threads, kv_type=args.kv_type,
                              state_dir=args.state_dir, max_queue=args.max_queue)
    try:
        settings.validate()
        service = Service(settings)
    except ValueError as e:
        print(f"dreamstage serve: {e}", file=sys.stderr)
        return 2
    service.start()
    cfg = service.model.config
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"dreamstage: serving {service.model_id} ({service.model.model_path}) at http://{host}:{args.port}/v1 "
          f"- {cfg.n_seq} slots x {service.engine.slot_ctx} tokens, kv {cfg.kv_type}, "
          f"{cfg.n_threads or 'all'} threads", flush=True)
    try:
        uvicorn.run(create_app(service), host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=5)
    finally:
        service.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dreamstage", description="A resident LLM that serves and keeps learning.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="version, pinned llama.cpp, patches, backends and devices")
    p.set_defaults(fn=cmd_info)
    p = sub.add_parser("serve", help="serve the resident model")
    p.add_argument("--model", default=None, help="GGUF path (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--parallel", type=int, default=4, help="slots decoded together (default 4)")
    p.add_argument("--ctx", type=int, default=4096, help="total context; each slot gets ctx/parallel (default 4096)")
    p.add_argument("--batch", type=int, default=512, help="tokens per decode batch (default 512)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: all cores)")
    p.add_argument("--kv-type", default="f16", help="serving K/V cache type: f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0")
    p.add_argument("--state-dir", default=None, help="where the dream stage keeps jobs and adapters")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 503 (default 64)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(fn=cmd_serve)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
