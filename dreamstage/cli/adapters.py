"""`dreamstage adapters ls | import | export | promote | rollback | rm`."""
from __future__ import annotations

import argparse

from dreamstage.cli.remote import client_flags, connect, table


def render_adapters(view: dict) -> str:
    """`dreamstage adapters ls`: one row per name: served version, versions, training."""
    rows = [[n["name"], f"v{n['served']['version']}" if n.get("served") else "-",
             ",".join(str(v) for v in n["versions"]), "yes" if n.get("training") else ""]
            for n in view.get("names", [])]
    return table(["adapter", "serves", "versions", "training"], rows) if rows else "no adapters"


def cmd_adapters(args: argparse.Namespace) -> int:
    import json

    with connect(args) as c:
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


def add_adapters(sub) -> None:
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
        client_flags(a)
    p.set_defaults(fn=cmd_adapters)
