"""libggml's backend and device registry, through ctypes: the backends loaded
and each device with its memory (the local ones, and RPC workers' when named).
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

from dreamstage import native


@lru_cache(maxsize=1)
def ggml() -> ctypes.CDLL:
    """libggml (the backend registry) from our library directory."""
    native.lib()  # libllama first: it pulls in the same libggml by RPATH
    G = ctypes.CDLL(str(native.lib_dir() / "libggml.so"))
    p = ctypes.c_void_p
    # size_t ggml_backend_reg_count(void); ggml_backend_reg_t ggml_backend_reg_get(size_t i);
    G.ggml_backend_reg_count.restype = ctypes.c_size_t
    G.ggml_backend_reg_get.argtypes = [ctypes.c_size_t]
    G.ggml_backend_reg_get.restype = p
    # const char * ggml_backend_reg_name(ggml_backend_reg_t reg);
    G.ggml_backend_reg_name.argtypes = [p]
    G.ggml_backend_reg_name.restype = ctypes.c_char_p
    # size_t ggml_backend_dev_count(void); ggml_backend_dev_t ggml_backend_dev_get(size_t i);
    G.ggml_backend_dev_count.restype = ctypes.c_size_t
    G.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    G.ggml_backend_dev_get.restype = p
    # const char * ggml_backend_dev_name(dev); const char * ggml_backend_dev_description(dev);
    G.ggml_backend_dev_name.argtypes = [p]
    G.ggml_backend_dev_name.restype = ctypes.c_char_p
    G.ggml_backend_dev_description.argtypes = [p]
    G.ggml_backend_dev_description.restype = ctypes.c_char_p
    # ggml_backend_reg_t ggml_backend_dev_backend_reg(dev);
    G.ggml_backend_dev_backend_reg.argtypes = [p]
    G.ggml_backend_dev_backend_reg.restype = p
    # void ggml_backend_dev_memory(dev, size_t * free, size_t * total);
    G.ggml_backend_dev_memory.argtypes = [p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    G.ggml_backend_dev_memory.restype = None
    return G


def backends() -> list[str]:
    G = ggml()
    return [G.ggml_backend_reg_name(G.ggml_backend_reg_get(i)).decode() for i in range(G.ggml_backend_reg_count())]


def devices(rpc: tuple[str, ...] = ()) -> list[dict]:
    """Each local ggml device with its free and total memory in bytes (the CPU's is host
    memory), and the devices of the RPC workers whose endpoints `rpc` names. Only those:
    asking the memory of a worker that is gone, with no model of this process connected
    to it, aborts the process (ggml's RPC client connects anew and aborts on failure)."""
    G = ggml()
    out = []
    for i in range(G.ggml_backend_dev_count()):
        d = G.ggml_backend_dev_get(i)
        if G.ggml_backend_reg_name(G.ggml_backend_dev_backend_reg(d)) == b"RPC" and \
                G.ggml_backend_dev_description(d).decode() not in rpc:
            continue
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        G.ggml_backend_dev_memory(d, ctypes.byref(free), ctypes.byref(total))
        out.append({"name": G.ggml_backend_dev_name(d).decode(),
                    "description": G.ggml_backend_dev_description(d).decode(),
                    "free": free.value, "total": total.value})
    return out
