"""`dreamstage serve`: its flags (one per ServerSettings field it sets) and the command."""
from __future__ import annotations

import argparse
import sys

# Connection limits (server/connections.py): flag help; each default is ServerSettings'.
CONNECTION_FLAGS = {
    "max_connections": (int, "open connections in all before new ones get 503 (lowered to fit the open-file limit)"),
    "max_connections_per_client": (int, "open connections from one client address (0: no limit, e.g. behind a "
                                        "proxy)"),
    "header_timeout_s": (float, "seconds a request's head may take from its first byte (Slowloris)"),
    "body_timeout_s": (float, "seconds a request's body may take after its head"),
    "keep_alive_s": (int, "seconds an idle keep-alive connection stays open"),
    "fd_reserve": (int, "file descriptors connections never take, for /health, the state store and model files"),
}


# `serve` flags that set a ServerSettings field of the same name. A flag not
# given leaves the field to DREAMSTAGE_<FIELD>, else to ServerSettings' default.
SERVE_FIELDS = ("model", "host", "port", "parallel", "ctx", "kv_unified", "batch", "threads", "kv_type", "adapter",
                "max_queue",
                "max_body_bytes", "n_gpu_layers", "api_key", "max_adapters", "adapter_max_rank",
                "adapter_budget_mib", "api_keys", "record_days", "record_mib", "learn",
                "learn_adapter", "follow", "follow_key", "follow_interval") + tuple(CONNECTION_FLAGS)


def serve_settings(args: argparse.Namespace):
    """The ServerSettings `serve` runs with: flags, then the environment, then the defaults."""
    from dreamstage.server.settings import JobLimits, ServerSettings
    from dreamstage.training.jobs.store import default_state_dir

    given = {k: getattr(args, k) for k in SERVE_FIELDS if getattr(args, k, None) is not None}
    if args.allowed_host:
        given["allowed_hosts"] = tuple(args.allowed_host)
    if args.cors_origin:
        given["cors_origins"] = tuple(args.cors_origin)
    limits = {k: getattr(args, k) for k in JobLimits.__dataclass_fields__ if getattr(args, k) is not None}
    if limits:
        given["limits"] = limits
    if args.no_drift_guard:
        given["drift_guard"] = False
    if args.strict_api:
        given["strict_api"] = True
    if args.embeddings:
        given["embeddings"] = True
    if args.record:
        given["record"] = True
    given.update(_placement_flags(args))
    if args.no_train:
        given["state_dir"] = None
    elif args.state_dir:
        given["state_dir"] = args.state_dir
    settings = ServerSettings(**given)
    if settings.state_dir is None and not args.no_train:      # neither a flag nor DREAMSTAGE_STATE_DIR
        settings = ServerSettings(**given, state_dir=str(default_state_dir()))
    return settings


def _placement_flags(args: argparse.Namespace) -> dict:
    """serve's --rpc, --tensor-split, --split-mode, --rpc-dead-after and --rpc-allow-remote as ServerSettings fields."""
    from dreamstage.serving import rpc

    given: dict = {}
    if args.rpc:
        given["rpc"] = tuple(str(e) for e in rpc.parse_endpoints(args.rpc))
    if args.tensor_split:
        given["tensor_split"] = rpc.parse_tensor_split(args.tensor_split)
    if args.split_mode:
        given["split_mode"] = args.split_mode
    if args.rpc_allow_remote:
        given["rpc_allow_remote"] = True
    if args.rpc_dead_after is not None:
        given["rpc_dead_after_s"] = args.rpc_dead_after
    return given


def _check_bind(host: str, port: int) -> None:
    """Fail in one line before the model loads when the address is taken
    (uvicorn would find out only after loading, and log several lines)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def cmd_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from dreamstage.server.app import create_app
    from dreamstage.server.service import Service, run_uvicorn
    from dreamstage.validation import field_errors

    try:
        settings = serve_settings(args)
        _check_bind(settings.host, settings.port)
        service = Service(settings)
    except ValidationError as e:
        print("dreamstage serve: " + "; ".join(m if p == "body" else f"{p}: {m}" for p, m in field_errors(e)),
              file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"dreamstage serve: {e}", file=sys.stderr)
        return 2
    state_dir = settings.state_dir
    service.start()
    cfg = service.model.config
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    training = f"jobs and adapters in {state_dir}" if state_dir else "training off"
    if settings.follow is not None:
        training = f"following {settings.follow} (adapters in {state_dir})"
    print(f"dreamstage: serving {service.model_id} ({service.model.model_path}) at http://{host}:{settings.port}/v1 "
          f"- {cfg.n_seq} slots {'sharing' if cfg.kv_unified else 'x'} {service.engine.slot_ctx} tokens, "
          f"kv {cfg.kv_type}, "
          f"{cfg.n_threads or 'all'} threads; {training}; "
          f"{'API key required' if settings.api_key else 'no API key'} "
          f"(adapter version {service.engine.adapter_version})", flush=True)
    run_uvicorn(service, create_app(service), host=settings.host, port=settings.port, log_level=args.log_level)
    return 0


def _add_rpc_flags(p, default: dict) -> None:
    """serve's placement over RPC workers (docs/architecture/rpc.md)."""
    p.add_argument("--rpc", default=None, metavar="HOST:PORT[,...]",
                   help="RPC workers (dreamstage rpc-worker) that hold layers, before any local GPU; loopback only "
                        "unless --rpc-allow-remote")
    p.add_argument("--tensor-split", dest="tensor_split", default=None, metavar="A,B,...",
                   help="each device's share of the offloaded layers, RPC workers first (llama.cpp's meaning; "
                        "default: by free memory); -ngl sets how many layers leave this process's CPU")
    p.add_argument("--split-mode", dest="split_mode", default=None, choices=["layer", "none"],
                   help=f"how layers spread over the devices (default {default['split_mode']})")
    p.add_argument("--rpc-dead-after", dest="rpc_dead_after", type=float, default=None, metavar="SECONDS",
                   help="a worker silent this long while a command waits on it fails: its host answers no "
                        "keepalive probe, or its process no byte (503 naming it; default "
                        f"{default['rpc_dead_after_s']:g}); raise it where one graph computes longer on a worker")
    p.add_argument("--rpc-allow-remote", action="store_true",
                   help="accept non-loopback RPC workers: RPC has no authentication or encryption, so only on a "
                        "network you trust (docs/architecture/rpc.md)")


def _add_follow_flags(p, default: dict) -> None:
    """serve's replica flags (docs/architecture/replicas.md)."""
    p.add_argument("--follow", default=None, metavar="URL",
                   help="a replica: serve the adapter versions promoted on the leader at URL (http://HOST:PORT), "
                        "and only those; training routes answer 409 naming it (docs/architecture/replicas.md)")
    p.add_argument("--follow-key", dest="follow_key", default=None, metavar="KEY",
                   help="the leader's API key, or a scoped key that reads its adapters (default: "
                        "$DREAMSTAGE_FOLLOW_KEY; prefer the variable)")
    p.add_argument("--follow-interval", dest="follow_interval", type=float, default=None, metavar="S",
                   help="seconds one wait on the leader lasts, and the pause before a retry "
                        f"(default {default['follow_interval']:g})")


def _add_record_flags(p, default) -> None:
    """`serve`'s records of served answers and learning from feedback (docs/architecture/feedback.md)."""
    p.add_argument("--record", action="store_true",
                   help="keep each served exchange (conversation, exact prompt tokens, answer, adapter, sampling) "
                        "for feedback: POST /v1/feedback, GET|DELETE /v1/records (default: off; a request with "
                        '"store": false is never kept)')
    p.add_argument("--record-days", dest="record_days", type=float, default=None, metavar="DAYS",
                   help=f"records older than this are deleted (default {default['record_days']:g})")
    p.add_argument("--record-mib", dest="record_mib", type=float, default=None, metavar="MIB",
                   help=f"past this the oldest records are deleted (default {default['record_mib']:g})")
    from dreamstage.records.store import LEARN_MODES
    p.add_argument("--learn", choices=LEARN_MODES, default=None,
                   help="the default adapter's learning from feedback: manual (POST /adapters/NAME/learn starts a "
                        "job) or auto (a job starts by itself); needs --record (default: as stored, manual)")
    p.add_argument("--learn-adapter", dest="learn_adapter", default=None, metavar="NAME",
                   help="the adapter feedback on the base model's answers trains "
                        f"(default {default['learn_adapter']})")


def add_serve(sub) -> None:
    """`dreamstage serve`: a flag per ServerSettings field it sets (SERVE_FIELDS)."""
    p = sub.add_parser("serve", help="serve the resident model",
                       description="Each option may also be set as DREAMSTAGE_<OPTION> (e.g. DREAMSTAGE_PORT=9000, "
                                   "DREAMSTAGE_LIMITS__MAX_QUEUED_JOBS=4); a flag wins over the environment.")
    from dreamstage.server.settings import JobLimits, ServerSettings
    default = {k: f.default for k, f in ServerSettings.model_fields.items()}
    p.add_argument("--model", default=None, help="GGUF path (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--host", default=None, help=f"bind address (default {default['host']}: loopback only)")
    p.add_argument("--port", type=int, default=None, help=f"(default {default['port']})")
    p.add_argument("--parallel", type=int, default=None, help=f"slots decoded together (default {default['parallel']})")
    p.add_argument("--ctx", type=int, default=None,
                   help="total context; each slot gets ctx/parallel, or all of it with --kv-unified (default: the "
                        "model's trained context per slot, or in all with --kv-unified, as far as "
                        f"{default['ctx_memory_share'] * 100:.0f}%% of the free memory holds the K/V)")
    p.add_argument("--kv-unified", action=argparse.BooleanOptionalAction, default=None,
                   help="one K/V pool all slots share, as llama-server's: a request may use the whole context "
                        "(default: off, one stream per slot, so a request's output does not depend on what else "
                        "is in its batch; docs/architecture/serving.md)")
    p.add_argument("--batch", type=int, default=None, help=f"tokens per decode batch (default {default['batch']})")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--n-gpu-layers", "-ngl", dest="n_gpu_layers", type=int, default=None, metavar="N",
                   help=f"layers stored on the GPU in a GPU build (default {default['n_gpu_layers']}: all; 0: none)")
    _add_rpc_flags(p, default)
    p.add_argument("--kv-type", default=None, help=f"serving K/V cache type: f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, "
                                                   f"q4_0 (default {default['kv_type']})")
    p.add_argument("--state-dir", default=None,
                   help="where the dream stage keeps jobs and adapters (default ~/.local/share/dreamstage)")
    p.add_argument("--adapter", default=None, metavar="PATH",
                   help="a GGUF LoRA to serve from startup (imported into the state directory as a new version)")
    p.add_argument("--max-adapters", dest="max_adapters", type=int, default=None, metavar="N",
                   help=f"named adapters resident beside the base (default {default['max_adapters']})")
    p.add_argument("--adapter-max-rank", dest="adapter_max_rank", type=int, default=None, metavar="R",
                   help="adapters of rank up to R share every decode batch; a wider one decodes in batches of "
                        f"its own (default {default['adapter_max_rank']})")
    p.add_argument("--adapter-budget-mib", dest="adapter_budget_mib", type=float, default=None, metavar="MIB",
                   help="memory the resident adapters' files may take (default: the device's free memory)")
    p.add_argument("--api-keys", dest="api_keys", default=None, metavar="FILE",
                   help='a JSON file of keys scoped to adapters: {"KEY": {"adapters": ["alice"], "train": true}}')
    p.add_argument("--max-queue", type=int, default=None,
                   help=f"requests waiting for a slot before 503 (default {default['max_queue']})")
    p.add_argument("--no-train", action="store_true", help="serve only: no /train, no adapters, no state directory")
    p.add_argument("--no-drift-guard", action="store_true",
                   help="train without the drift guard: no anchor regularizer, no drift figures, and promote=auto "
                        "checks the held-out loss only (docs/architecture/drift.md)")
    p.add_argument("--embeddings", action="store_true",
                   help="serve POST /v1/embeddings: mean-pooled last hidden states of the resident model")
    _add_record_flags(p, default)
    _add_follow_flags(p, default)
    p.add_argument("--strict-api", action="store_true",
                   help="refuse unknown fields on the OpenAI routes with a 400 (default: ignore them and name them "
                        "in the X-Dreamstage-Ignored-Fields header)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $DREAMSTAGE_API_KEY); "
                        "needed for training on a non-loopback bind; prefer the variable: "
                        "a command line is visible to other local users")
    p.add_argument("--allowed-host", action="append", metavar="NAME",
                   help="a Host header name accepted besides localhost/127.0.0.1/::1 (repeatable)")
    p.add_argument("--cors-origin", action="append", metavar="ORIGIN",
                   help="an origin (https://app.example) that gets CORS headers (repeatable; default none)")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help=f"larger request bodies get 413 (default {default['max_body_bytes']})")
    for name, (kind, text) in CONNECTION_FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None,
                       help=f"{text} (default {default[name]})")
    for name, f in JobLimits.__dataclass_fields__.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=None,
                       help=f"training limit (default {f.default})")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(fn=cmd_serve)
