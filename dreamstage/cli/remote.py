"""What the commands that talk to a running server share: the client, its flags and tables."""
from __future__ import annotations


def api_key(args) -> str | None:
    from dreamstage import environment

    return getattr(args, "api_key", None) or environment.get("DREAMSTAGE_API_KEY")


def connect(args):
    from dreamstage.client import Client
    return Client(args.url, timeout=60, api_key=api_key(args))


def client_flags(p) -> None:
    """The flags of a command that talks to a running server."""
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--api-key", default=None, help="the server's API key (default: $DREAMSTAGE_API_KEY)")


def table(headers: list[str], rows: list[list]) -> str:
    """Left-aligned columns, two spaces apart; None shows as '-'."""
    cells = [headers] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def num(v, digits: int = 3):
    return None if v is None else f"{v:.{digits}f}"
