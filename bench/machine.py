"""What a benchmark ran on, written into its results the same way by every bench: the CPU's name
and its widest vector extension (the same 2-core VM has been an AVX-512 host and an AVX2 one about
half as fast), the core count, and the load when it is asked."""
from __future__ import annotations

import os
import platform
from functools import lru_cache
from pathlib import Path

# Widest first: the first flag /proc/cpuinfo lists names the row.
VECTOR_FLAGS = (("avx512f", "avx512"), ("avx2", "avx2"), ("avx", "avx"), ("sve", "sve"), ("asimd", "neon"))


@lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            out.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return out


def cpu_name() -> str:
    info = _cpuinfo()
    return info.get("model name") or info.get("Model") or platform.processor() or platform.machine()


def vector_isa() -> str:
    info = _cpuinfo()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    return next((name for flag, name in VECTOR_FLAGS if flag in flags), "")


def describe() -> dict:
    """The machine as a results file records it."""
    return {"cpu": cpu_name(), "vector": vector_isa(), "cores": os.cpu_count(), "arch": platform.machine(),
            "load_1m": round(os.getloadavg()[0], 2)}
