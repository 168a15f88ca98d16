"""`dreamstage feedback`: correct, rate or compare recorded answers, or start a job of them."""
from __future__ import annotations

import argparse

from dreamstage.cli.remote import client_flags, connect


def _answer_ref(raw: str) -> str | dict:
    """ID, or ID:INDEX for a choice other than the first."""
    rid, sep, index = raw.rpartition(":")
    if sep and index.isdigit():
        return {"id": rid, "index": int(index)}
    return raw


def cmd_feedback(args: argparse.Namespace) -> int:
    with connect(args) as c:
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


def add_feedback(sub) -> None:
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
    client_flags(p)
    p.set_defaults(fn=cmd_feedback)
