"""`dreamstage train` (post a JSONL file of examples) and `dreamstage status` (what serves and trains)."""
from __future__ import annotations

import argparse
import sys

from dreamstage.cli.remote import client_flags, connect, num, table


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

    from dreamstage.client.wire import DreamstageError

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
    with connect(args) as c:
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


def render_status(view: dict, ads: dict) -> str:
    """`dreamstage status`: what serves, the jobs (training now, then the queue) and the adapters."""
    from dreamstage.client.progress import eta_s, format_duration, progress_fraction

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
                         num(p.get("loss_avg")), num(p.get("eval_loss")), num(p.get("train_tok_s"), 1),
                         format_duration(eta_s(job)), p.get("refusals", 0), job["out"]])
        lines.append(table(["JOB", "STATE", "DONE", "EPOCH", "STEP", "LOSS", "HELD-OUT", "TOK/S", "ETA",
                             "REFUSALS", "ADAPTER"], rows))
    else:
        lines.append("no job training or queued")
    adapters = ads.get("adapters") or []
    if adapters:
        lines.append("")
        lines.append(table(["ADAPTER", "VERSION", "HELD-OUT", "JOB", "SERVING"],
                            [[a["name"], a["version"], num(a.get("eval_loss")), a.get("job_id"),
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

    from dreamstage.client.progress import progress_line
    from dreamstage.client.wire import DreamstageError

    with connect(args) as c:
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


def add_train(sub) -> None:
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
    client_flags(p)
    p.set_defaults(fn=cmd_train)
    p = sub.add_parser("status", help="the served adapter, the job training now and the queue (or one job)")
    p.add_argument("job", nargs="?", type=int, help="a job id: its progress, message and refusals")
    client_flags(p)
    p.set_defaults(fn=cmd_status)
