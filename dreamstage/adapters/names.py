"""Adapter names: what a name may be, checked once where a name enters (requests, settings, routes)."""
from __future__ import annotations

import re

from dreamstage.adapters.choice import BASE_NAME

# A bare adapter name: no separators, no leading dot, so it can never leave the
# state directory's adapters/ folder. Matched with fullmatch (`$` would allow a trailing "\n").
ADAPTER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_adapter_name(name: str, field_name: str = "out") -> str:
    """A bare, safe adapter name, not "base" (the name of no adapter); raise ValueError naming it otherwise."""
    if not isinstance(name, str) or not ADAPTER_NAME_RE.fullmatch(name) or ".." in name or name.endswith("."):
        raise ValueError(
            f"{field_name} {name!r} is not a bare adapter name (letters, digits, '_', '-', '.', "
            "at most 64, starting with a letter or digit, no paths)"
        )
    if name == BASE_NAME:
        raise ValueError(f"{field_name} {name!r} is reserved: it selects the base model, no adapter")
    return name
