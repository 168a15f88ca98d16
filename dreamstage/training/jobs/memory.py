"""Native heap hygiene after a job."""
from __future__ import annotations

import ctypes


def release_freed_memory() -> None:
    """Give freed heap back to the OS after a job's trainers are closed.

    glibc keeps freed chunks in its arenas, so a trainer's few hundred MB stayed
    in the process's RSS after a cancel although nothing used them."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass                    # not glibc: nothing to trim
