"""The request fields that had no effect: named in a response header and the
log, or refused with --strict-api (schemas.ignored_fields finds them)."""
from __future__ import annotations

import logging
from urllib.parse import quote

from dreamstage.server.errors import APIError
from dreamstage.server.schemas import ignored_fields

log = logging.getLogger("dreamstage.server")

# The request fields that had no effect (unknown ones and IGNORED_EXTRAS), comma-separated.
IGNORED_HEADER = "X-Dreamstage-Ignored-Fields"
_HEADER_NAMES = 16          # at most this many names in the header, then "+N more"
_logged_ignored: set[str] = set()   # each ignored path is logged once per process
_LOG_IGNORED_MAX = 256


def field_headers(body, strict: bool) -> dict[str, str]:
    """The ignored-fields header for `body`; with `strict`, an unknown field is a 400 naming it."""
    unknown, extras = ignored_fields(body)
    if unknown and strict:
        raise APIError(400, f"{unknown[0]}: unknown field (the server runs with --strict-api)", unknown[0],
                       "invalid_value")
    names = unknown + extras
    if not names:
        return {}
    fresh = [n for n in names if n not in _logged_ignored]
    if fresh and len(_logged_ignored) < _LOG_IGNORED_MAX:
        _logged_ignored.update(fresh)
        log.warning("request fields ignored: %s", ", ".join(fresh[:_HEADER_NAMES]))
    # quoted: a field name may hold any character, and a header value only visible ASCII
    shown = [quote(n[:64], safe="[]._-") for n in names[:_HEADER_NAMES]]
    if len(names) > _HEADER_NAMES:
        shown.append(f"+{len(names) - _HEADER_NAMES} more")
    return {IGNORED_HEADER: ", ".join(shown)}
