"""Naming the field a bad request got wrong, the same way for every route and the CLI.

pydantic reports a location as a tuple (`('body', 'messages', 0, 'role')`);
clients are told the path (`messages[0].role`) and one message per field.
"""
from __future__ import annotations

from pydantic import ValidationError

# pydantic puts a union member's type name into the location; it is not a field.
_NOT_FIELDS = ("str", "int", "float", "bool", "list", "dict", "function-after")


def field_path(loc) -> str:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            if any(c in str(part) for c in "[]") or part in _NOT_FIELDS:
                continue
            out += ("." if out else "") + str(part)
    return out or "body"


def field_errors(e: ValidationError) -> list[tuple[str, str]]:
    """(path, message) per field, in pydantic's order, each once."""
    out, seen = [], set()
    for err in e.errors():
        path = field_path(err.get("loc", ()))
        if err.get("type") == "extra_forbidden":
            msg = "unknown field"
        elif err.get("type") == "missing":
            msg = "field required"
        else:
            msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if (path, msg) not in seen:
            seen.add((path, msg))
            out.append((path, msg))
    return out or [("body", "invalid body")]
