"""The `dreamstage` command line."""
from __future__ import annotations

import argparse
import os
import sys


def cmd_info(args: argparse.Namespace) -> int:
    from dreamstage import info
    print(info.render(info.collect()))
    return 0


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
    """serve's --rpc, --tensor-split, --split-mode and --rpc-allow-remote as ServerSettings fields."""
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
    return given


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


def _add_rpc_worker(sub) -> None:
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


def _api_key(args) -> str | None:
    from dreamstage import environment

    return getattr(args, "api_key", None) or environment.get("DREAMSTAGE_API_KEY")


def _client(args):
    from dreamstage.client import Client
    return Client(args.url, timeout=60, api_key=_api_key(args))


def _read_examples(path: str) -> list[dict]:
    """A JSONL file: one example per line (text, prompt/completion, messages, or a group)."""
    import json

    examples = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ex = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not valid JSON: {e}") from None
            if not isinstance(ex, dict):
                raise ValueError(f"{path}:{n}: an example is a JSON object, not {type(ex).__name__}")
            examples.append(ex)
    if not examples:
        raise ValueError(f"{path}: no examples")
    return examples


def _options(pairs: list[str]) -> dict:
    """KEY=VALUE pairs; VALUE is JSON when it parses (3, 0.5, true, "x"), else a string."""
    import json

    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {pair!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def cmd_train(args: argparse.Namespace) -> int:
    import httpx

    from dreamstage.client import DreamstageError

    try:
        examples = _read_examples(args.file)
        fields = _options(args.set or [])
    except (OSError, ValueError) as e:
        print(f"dreamstage train: {e}", file=sys.stderr)
        return 2
    for key in ("epochs", "lr", "promote", "out", "window", "val_split", "chunk", "horizon"):
        if getattr(args, key) is not None:
            fields[key] = getattr(args, key)
    for key in ("exact", "recompute", "group_prefix"):
        if getattr(args, key):
            fields[key] = True
    with _client(args) as c:
        try:
            job = c.train(examples, **fields)
            print(f"job {job['id']} {job['state']}: {len(examples)} examples, window {job['window']}, "
                  f"chunk {job['chunk']}, cache {job['context_cache_type']}")
            if not args.wait:
                return 0
            job = c.wait(job["id"])
        except DreamstageError as e:
            where = f" ({e.param})" if e.param else ""
            print(f"dreamstage train: {e.status}{where}: {e.message}", file=sys.stderr)
            return 2
        except httpx.HTTPError as e:
            print(f"dreamstage train: cannot reach {args.url}: {e}", file=sys.stderr)
            return 1
    print(f"job {job['id']} {job['state']}: {job['message'] or ''}")
    return 0 if job["state"] == "done" else 1


def _table(headers: list[str], rows: list[list]) -> str:
    """Left-aligned columns, two spaces apart; None shows as '-'."""
    cells = [headers] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def _num(v, digits: int = 3):
    return None if v is None else f"{v:.{digits}f}"


def render_status(view: dict, ads: dict) -> str:
    """`dreamstage status`: what serves, the jobs (training now, then the queue) and the adapters."""
    from dreamstage.client import eta_s, format_duration, progress_fraction

    served = ads.get("served")
    lines = [f"serving adapter version {ads['served_version']}"
             + (f" ({served['name']} v{served['version']})" if served else " (base model)")]
    if ads.get("served_error"):
        lines.append(f"  {ads['served_error']}")
    jobs = ([view["current"]] if view.get("current") else []) + list(view.get("queue") or [])
    lines.append("")
    if jobs:
        rows = []
        for job in jobs:
            p = job.get("progress") or {}
            done, total = progress_fraction(job)
            epochs = p.get("epochs") or 1
            rows.append([job["id"], job["state"], f"{done / total:.0%}" if total else "0%",
                         f"{min((p.get('epoch') or 0) + 1, epochs)}/{epochs}", p.get("step", 0),
                         _num(p.get("loss_avg")), _num(p.get("eval_loss")), _num(p.get("train_tok_s"), 1),
                         format_duration(eta_s(job)), p.get("refusals", 0), job["out"]])
        lines.append(_table(["JOB", "STATE", "DONE", "EPOCH", "STEP", "LOSS", "HELD-OUT", "TOK/S", "ETA",
                             "REFUSALS", "ADAPTER"], rows))
    else:
        lines.append("no job training or queued")
    adapters = ads.get("adapters") or []
    if adapters:
        lines.append("")
        lines.append(_table(["ADAPTER", "VERSION", "HELD-OUT", "JOB", "SERVING"],
                            [[a["name"], a["version"], _num(a.get("eval_loss")), a.get("job_id"),
                              f"v{a['served_version']}" if a.get("promoted") else ""] for a in adapters]))
    return "\n".join(lines)


def group_line(label: str, g: dict) -> str:
    """One shared-prefix group of a job: its shape and each reply's loss (weight in brackets)."""
    losses = ", ".join(f"{'-' if x is None else f'{x:.3f}'} [{w:g}]"
                       for x, w in zip(g["reply_losses"], g["weights"], strict=True))
    path = "prompt shared" if g.get("shared_prefix") else "prompt per reply (faster here)"
    return (f"group {label}: prompt {g['prefix_tokens']} tokens, {g['G']} replies of {g['reply_tokens']} tokens, "
            f"{path}; reply losses {losses}")


def cmd_status(args: argparse.Namespace) -> int:
    import httpx

    from dreamstage.client import DreamstageError, progress_line

    with _client(args) as c:
        try:
            if args.job is not None:
                job = c.train_state(args.job)
                print(progress_line(job))
                if job.get("message"):
                    print(f"  {job['message']}")
                for r in job.get("refusals", []):
                    print(f"  refused: chunk at {r['refused_chunk_pos']} ({r['refused_chunk_tokens']} tokens) "
                          f"needs {r['refused_need_mib']:.1f} MiB, allowance {r['refused_allowance_mib']:.1f} MiB")
                for label, g in (job.get("progress") or {}).get("groups", {}).items():
                    print(f"  {group_line(label, g)}")
                return 0
            view, ads = c.train_overview(), c.adapters()
        except DreamstageError as e:
            print(f"dreamstage status: {e.status}: {e.message}", file=sys.stderr)
            return 2
        except httpx.HTTPError as e:
            print(f"dreamstage status: cannot reach {args.url}: {e}", file=sys.stderr)
            return 1
    print(render_status(view, ads))
    return 0


def render_adapters(view: dict) -> str:
    """`dreamstage adapters ls`: one row per name: served version, versions, training."""
    rows = [[n["name"], f"v{n['served']['version']}" if n.get("served") else "-",
             ",".join(str(v) for v in n["versions"]), "yes" if n.get("training") else ""]
            for n in view.get("names", [])]
    return _table(["adapter", "serves", "versions", "training"], rows) if rows else "no adapters"


def cmd_adapters(args: argparse.Namespace) -> int:
    import json

    with _client(args) as c:
        if args.action == "ls":
            print(render_adapters(c.adapters()))
            return 0
        if args.action == "import":
            got = c.import_adapter(args.name, args.path, promote=not args.no_promote)
            print(f"imported {args.name} v{got['imported']['version']}")
        elif args.action == "export":
            dest = c.export_adapter(args.name, args.version, args.dest, format=args.format)
            print(f"wrote {dest}")
        elif args.action == "promote":
            got = c.promote(args.name, args.version)
            print(f"{args.name} serves v{got['served']['version']} (served version {got['served']['served_version']})")
        elif args.action == "rollback":
            got = c.rollback(args.name)
            print(json.dumps(got.get("served")))
        else:
            c.remove_adapter(args.name)
            print(f"unloaded {args.name}")
    return 0


def _answer_ref(raw: str) -> str | dict:
    """ID, or ID:INDEX for a choice other than the first."""
    rid, sep, index = raw.rpartition(":")
    if sep and index.isdigit():
        return {"id": rid, "index": int(index)}
    return raw


def cmd_feedback(args: argparse.Namespace) -> int:
    with _client(args) as c:
        if args.learn:
            job = c.learn(args.learn)
            print(f"job {job['id']} ({job['state']}) learns {args.learn}'s feedback")
            return 0
        got = c.feedback(args.id, index=args.index, correction=args.correction, rating=args.rating,
                         preferred=_answer_ref(args.preferred) if args.preferred else None,
                         rejected=_answer_ref(args.rejected) if args.rejected else None)
    learn = got["learn"]
    print(f"feedback {got['id']} ({got['kind']}) for adapter {got['adapter']}: {got['pending']} pending; learning "
          f"{learn['mode']}" + (f" (a job at {learn['examples']} or {learn['minutes']:g} min after the last)"
                                if learn["mode"] == "auto" else f" (dreamstage feedback --learn {got['adapter']})"))
    return 0


def _add_feedback(sub) -> None:
    """`dreamstage feedback ID --correction TEXT | --rating X`, `--preferred ID --rejected ID`, `--learn NAME`."""
    p = sub.add_parser("feedback", help="correct, rate or compare recorded answers (serve --record), or start a job "
                                        "of an adapter's pending feedback")
    p.add_argument("id", nargs="?", help="the completion id the answer carried")
    p.add_argument("--index", type=int, default=0, help="the choice of an n > 1 answer (default 0)")
    kind = p.add_mutually_exclusive_group(required=True)
    kind.add_argument("--correction", metavar="TEXT", help="the answer it should have given")
    kind.add_argument("--rating", type=float, help="a number: +1 / -1, or any scale (docs/architecture/feedback.md)")
    kind.add_argument("--preferred", metavar="ID[:INDEX]", help="the better of two answers to one prompt (with "
                                                                "--rejected)")
    kind.add_argument("--learn", metavar="NAME", help="start a job of NAME's pending feedback now")
    p.add_argument("--rejected", metavar="ID[:INDEX]", help="the worse of the two")
    _client_flags(p)
    p.set_defaults(fn=cmd_feedback)


def _client_flags(p) -> None:
    """The flags of a command that talks to a running server."""
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--api-key", default=None, help="the server's API key (default: $DREAMSTAGE_API_KEY)")


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


def _add_serve(sub) -> None:
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


def _add_train(sub) -> None:
    """`dreamstage train` and `dreamstage status`."""
    p = sub.add_parser("train", help="post a JSONL file of examples to POST /train")
    p.add_argument("file", help="JSONL: one example per line (text, prompt/completion, messages, or a group: "
                                "{prompt | messages, completions: [text or {text | message, weight}]})")
    p.add_argument("--wait", action="store_true", help="poll until the job ends, with a progress bar on stderr")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--window", type=int, default=None)
    p.add_argument("--val-split", dest="val_split", type=float, default=None)
    p.add_argument("--promote", choices=["never", "manual", "auto"], default=None)
    p.add_argument("--out", default=None, help="the adapter's name")
    p.add_argument("--chunk", type=int, default=None, help="tokens per micro-step")
    p.add_argument("--exact", action="store_true",
                   help="the exact walk: the whole-window gradient through the cached K/V (a reverse pass per window)")
    p.add_argument("--horizon", type=int, default=None,
                   help="with --exact: only the last H positions before a chunk receive its gradient (default: all)")
    p.add_argument("--recompute", action="store_true", help="activation checkpointing inside a chunk")
    p.add_argument("--group-prefix", dest="group_prefix", action="store_true",
                   help="examples with one rendered prompt train as one shared-prefix group (the prompt once)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="any other /train field, the value as JSON when it parses (e.g. --set rank=16)")
    _client_flags(p)
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("status", help="the served adapter, the job training now and the queue (or one job)")
    p.add_argument("job", nargs="?", type=int, help="a job id: its progress, message and refusals")
    _client_flags(p)
    p.set_defaults(fn=cmd_status)


def _add_adapters(sub) -> None:
    """`dreamstage adapters ls | import | export | promote | rollback | rm`."""
    p = sub.add_parser("adapters", help="list, import, export, promote, roll back or unload named adapters")
    acts = p.add_subparsers(dest="action", required=True)
    acts.add_parser("ls", help="every adapter name: its served version and stored versions")
    a = acts.add_parser("import", help="a GGUF LoRA file or a PEFT folder, as a new version of NAME")
    a.add_argument("name")
    a.add_argument("path")
    a.add_argument("--no-promote", action="store_true", help="store it without serving it")
    a = acts.add_parser("export", help="download a version: the GGUF, or --format peft (a zip)")
    a.add_argument("name")
    a.add_argument("version", type=int)
    a.add_argument("dest")
    a.add_argument("--format", choices=["gguf", "peft"], default="gguf")
    a = acts.add_parser("promote", help="serve a version of NAME (default: its latest)")
    a.add_argument("name")
    a.add_argument("version", type=int, nargs="?")
    a = acts.add_parser("rollback", help="undo NAME's latest promotion (no NAME: the latest of any)")
    a.add_argument("name", nargs="?")
    a = acts.add_parser("rm", help="unload NAME: it serves nothing; its versions stay stored")
    a.add_argument("name")
    for a in acts.choices.values():
        _client_flags(a)
    p.set_defaults(fn=cmd_adapters)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dreamstage", description="A resident LLM that serves and keeps learning.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="version, pinned llama.cpp, patches, backends and devices")
    p.set_defaults(fn=cmd_info)
    _add_serve(sub)
    _add_train(sub)
    _add_adapters(sub)
    _add_feedback(sub)
    _add_rpc_worker(sub)
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


if __name__ == "__main__":
    sys.exit(main())
