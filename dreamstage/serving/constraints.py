"""A request's constraint on its answer as GBNF (llama.cpp's grammar, root rule "root"): a JSON
schema, a regular expression the whole answer matches, or a choice of strings.

Regular expressions are read by Python's own parser (`re`), so what is accepted is what `re`
accepts, with the same meaning for a full match: "." excludes a newline (unless (?s)),
\\d \\w \\s are their ASCII classes. What a grammar cannot hold is refused by name:
lookarounds, backreferences, anchors inside the pattern, case-insensitive matching.
"""
from __future__ import annotations

import importlib
import json
import re
from typing import Any

from dreamstage.serving.sampling import GrammarError, json_schema_grammar


def _re_module(name: str, before_311: str) -> Any:
    try:
        return importlib.import_module(f"re.{name}")           # Python 3.11+
    except ImportError:
        return importlib.import_module(before_311)             # Python 3.10


_c = _re_module("_constants", "sre_constants")
_sre = _re_module("_parser", "sre_parse")

MAX_PATTERN_CHARS = 1 << 16
_CATEGORIES = {
    _c.CATEGORY_DIGIT: (False, "0-9"), _c.CATEGORY_NOT_DIGIT: (True, "0-9"),
    _c.CATEGORY_WORD: (False, "0-9A-Za-z_"), _c.CATEGORY_NOT_WORD: (True, "0-9A-Za-z_"),
    _c.CATEGORY_SPACE: (False, " \\t\\n\\r\\x0C\\x0B"), _c.CATEGORY_NOT_SPACE: (True, " \\t\\n\\r\\x0C\\x0B"),
}


def constraint_grammar(kind: str, value: Any) -> str:
    """GBNF for one constraint: kind "gbnf" (value: the grammar), "json" (a schema, its JSON text,
    or None: any JSON value), "regex" (a pattern), "choice" (a list of strings)."""
    if kind == "gbnf":
        return value
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise GrammarError(f"the JSON schema is not JSON: {e}") from None
            if not isinstance(value, dict):
                raise GrammarError("the JSON schema must be a JSON object")
        return json_schema_grammar(value)
    if kind == "regex":
        return regex_grammar(value)
    if kind == "choice":
        return choice_grammar(value)
    raise ValueError(f"unknown constraint kind {kind!r}")


def choice_grammar(choices: list[str]) -> str:
    """GBNF whose language is exactly the strings in `choices` (none of them empty)."""
    if not choices or any(not c for c in choices):
        raise GrammarError("a choice needs at least one string, and no empty one")
    return "root ::= " + " | ".join(gbnf_literal(c) for c in dict.fromkeys(choices))


def gbnf_literal(text: str) -> str:
    """`text` as a GBNF string literal."""
    return '"' + "".join(_char(ch, '"') for ch in text) + '"'


def regex_grammar(pattern: str) -> str:
    """GBNF whose language is the strings `pattern` matches whole (re.fullmatch); a leading "^"
    and a trailing "$" are allowed and mean nothing more."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise GrammarError(f"the regex has {len(pattern)} characters, more than {MAX_PATTERN_CHARS}")
    try:                                # re's parser and _sequence both recurse once per nested group
        return _regex_grammar(pattern)
    except RecursionError:
        raise GrammarError(f"regex {pattern[:80]!r}: its groups nest too deeply") from None


def _regex_grammar(pattern: str) -> str:
    try:
        parsed = _sre.parse(pattern)
    except re.error as e:
        raise GrammarError(f"regex {pattern[:80]!r} is not a regular expression: {e}") from None
    dotall = bool(parsed.state.flags & re.DOTALL)
    if parsed.state.flags & re.IGNORECASE:
        raise GrammarError(f"regex {pattern[:80]!r}: case-insensitive matching cannot be a grammar here")
    items = list(parsed)
    if items and items[0] == (_c.AT, _c.AT_BEGINNING):
        items = items[1:]
    if items and items[-1][0] is _c.AT and items[-1][1] in (_c.AT_END, _c.AT_END_STRING):
        items = items[:-1]
    return "root ::= " + _sequence(items, dotall, pattern)


def _sequence(items, dotall: bool, pattern: str) -> str:
    out = [_item(op, av, dotall, pattern) for op, av in items]
    return " ".join(out) if out else '""'


def _item(op, av, dotall: bool, pattern: str) -> str:
    if op is _c.LITERAL:
        return gbnf_literal(chr(av))
    if op is _c.NOT_LITERAL:
        return f"[^{_char(chr(av), ']')}]"
    if op is _c.ANY:
        return "[\\x00-\\U0010FFFF]" if dotall else "[^\\n]"
    if op is _c.IN:
        return _class(av, pattern)
    if op is _c.BRANCH:
        return "(" + " | ".join(_sequence(list(alt), dotall, pattern) for alt in av[1]) + ")"
    if op is _c.SUBPATTERN:
        group, add_flags, del_flags, sub = av
        if add_flags & re.IGNORECASE:
            raise GrammarError(f"regex {pattern[:80]!r}: case-insensitive matching cannot be a grammar here")
        inner = bool(add_flags & re.DOTALL) or (dotall and not del_flags & re.DOTALL)
        return "(" + _sequence(list(sub), inner, pattern) + ")"
    if op in (_c.MAX_REPEAT, _c.MIN_REPEAT, getattr(_c, "POSSESSIVE_REPEAT", None)):
        lo, hi, sub = av           # a lazy or possessive repeat matches the same whole strings
        body = "(" + _sequence(list(sub), dotall, pattern) + ")"
        if hi is _c.MAXREPEAT:
            return body + ("*" if lo == 0 else "+" if lo == 1 else f"{{{lo},}}")
        return body + ("?" if (lo, hi) == (0, 1) else f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}")
    what = {_c.AT: "an anchor inside the pattern", _c.ASSERT: "a lookaround", _c.ASSERT_NOT: "a lookaround",
            _c.GROUPREF: "a backreference", _c.GROUPREF_EXISTS: "a conditional group"}.get(op, str(op))
    raise GrammarError(f"regex {pattern[:80]!r}: {what} cannot be a grammar")


def _class(items, pattern: str) -> str:
    negate, parts = False, []
    for op, av in items:
        if op is _c.NEGATE:
            negate = True
        elif op is _c.LITERAL:
            parts.append(_char(chr(av), "]"))
        elif op is _c.RANGE:
            parts.append(f"{_char(chr(av[0]), ']')}-{_char(chr(av[1]), ']')}")
        elif op is _c.CATEGORY and av in _CATEGORIES:
            neg, chars = _CATEGORIES[av]
            if neg and (negate or len(items) > 1):
                raise GrammarError(f"regex {pattern[:80]!r}: a negated class (\\D, \\W, \\S) inside a set "
                                   "cannot be a grammar here")
            negate = negate or neg
            parts.append(chars)
        else:
            raise GrammarError(f"regex {pattern[:80]!r}: the set item {op} cannot be a grammar")
    return "[" + ("^" if negate else "") + "".join(parts) + "]"


def _char(ch: str, quote: str) -> str:
    """One character inside a GBNF literal (quote '"') or character class (quote ']')."""
    n = ord(ch)
    if ch in ("\\", quote) or (quote == "]" and ch in "-^["):
        return "\\" + ch if ch in '\\"[]' else f"\\x{n:02X}"
    if ch == "\n":
        return "\\n"
    if ch == "\r":
        return "\\r"
    if ch == "\t":
        return "\\t"
    if n < 0x20 or n == 0x7F:
        return f"\\x{n:02X}"
    return ch
