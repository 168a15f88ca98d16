"""The resident model across machines: llama.cpp's RPC workers as ggml devices.

`dreamstage rpc-worker` runs dreamstage-rpc-server (upstream's tools/rpc built
against our patched ggml, installed beside our libraries). A serving process
registers each worker's devices with ggml (`connect`), and llama.cpp places
layers on them as it places them on GPUs (`--tensor-split`, `--split-mode`);
ggml's scheduler then runs every graph, the dream stage's training graphs
included, across the local backends and the workers.

RPC has no authentication and no encryption: whoever reaches a worker's port
can read and write its memory, and a worker computes whatever graph it is sent.
Workers bind loopback by default and a serving process refuses a non-loopback
endpoint unless told otherwise (docs/architecture/rpc.md, "Trust").
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from dreamstage import native
from dreamstage.native import ggml_registry

WORKER_PROGRAM = "dreamstage-rpc-server"
DEFAULT_WORKER_PORT = 50052      # upstream rpc-server's default
CONNECT_TIMEOUT_S = 3.0          # a worker that does not accept within this is refused by name
# A worker silent for this long while this process waits on it has failed (`keep_alive`):
# its host answers nothing, not even TCP keepalive probes (it vanished: no FIN, no RST), or
# its process sends no byte of an awaited answer (stopped, deadlocked). One graph that
# computes longer on a worker (a large model on a slow CPU) needs a larger bound.
DEAD_AFTER_S = 30.0
DEAD_AFTER_RANGE = (2.0, 3600.0)    # the values it may be set to, seconds
SPLIT_MODES = {"none": 0, "layer": 1}   # llama_split_mode; "row" needs a GPU backend's split buffers

# Endpoints registered with ggml in this process: ggml_backend_register appends a
# worker's devices again each time, so each endpoint is registered once.
_registered: dict[str, list[int]] = {}
# Per endpoint, the process's failure count when a model last connected to it: a
# failure before that was an earlier connection's (the worker has been restarted).
_connected_after: dict[str, int] = {}


class WorkerFailed(RuntimeError):
    """Work refused on a model whose RPC worker failed, until the engine has loaded it again."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def loopback(self) -> bool:
        if self.host.lower() == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def parse_endpoints(text: str) -> tuple[Endpoint, ...]:
    """'HOST:PORT[,HOST:PORT...]' -> endpoints; ValueError naming the bad entry."""
    out = []
    for item in (s.strip() for s in text.split(",")):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"rpc endpoint {item!r} is not HOST:PORT (port 1-65535)")
        if ":" in host:
            raise ValueError(f"rpc endpoint {item!r}: IPv6 workers are not supported (upstream's client takes "
                             "the first ':' as the port separator)")
        out.append(Endpoint(host, int(port)))
    if len({str(e) for e in out}) != len(out):
        raise ValueError(f"rpc endpoints {text!r} name a worker twice")
    return tuple(out)


def check_remote(endpoints: tuple[Endpoint, ...], allow_remote: bool) -> None:
    """Refuse a non-loopback worker unless allow_remote (RPC has no authentication)."""
    for e in endpoints:
        if not e.loopback and not allow_remote:
            raise ValueError(f"rpc endpoint {e} is not a loopback address; RPC has no authentication or "
                             "encryption (anyone who reaches the port controls the worker): pass "
                             "--rpc-allow-remote only on a network you trust")


def parse_tensor_split(text: str) -> tuple[float, ...]:
    """'a,b,c' -> proportions (llama.cpp's --tensor-split); ValueError naming the bad entry."""
    out = []
    for item in (s.strip() for s in text.split(",")):
        try:
            v = float(item)
        except ValueError:
            raise ValueError(f"tensor_split entry {item!r} is not a number") from None
        if not v >= 0 or v == float("inf"):
            raise ValueError(f"tensor_split entry {item!r} must be a finite number >= 0")
        out.append(v)
    if not any(out):
        raise ValueError("tensor_split needs at least one entry above 0")
    return tuple(out)


def worker_program() -> Path:
    """The worker binary this build installed beside its libraries."""
    p = native.lib_dir() / WORKER_PROGRAM
    if not p.is_file():
        raise native.NativeLibraryError(f"{p} is missing: this build has no RPC worker (DREAMSTAGE_RPC=OFF?)")
    return p


def probe(endpoint: Endpoint, timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
    """None when the worker accepts a connection, else why not: a named error within
    `timeout_s`, where ggml's own connection would wait for the kernel (and, patched,
    fail the worker's commands rather than say why)."""
    try:
        with socket.create_connection((endpoint.host, endpoint.port), timeout=timeout_s):
            return None
    except OSError as e:
        return f"rpc worker {endpoint} is not reachable: {e.strerror or e}"


def _ggml():
    G = ggml_registry.ggml()
    if not hasattr(G, "_dream_rpc"):
        p = ctypes.c_void_p
        G.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
        G.ggml_backend_reg_by_name.restype = p
        G.ggml_backend_reg_get_proc_address.argtypes = [p, ctypes.c_char_p]
        G.ggml_backend_reg_get_proc_address.restype = p
        G.ggml_backend_register.argtypes = [p]
        G.ggml_backend_register.restype = None
        G._dream_rpc = G.ggml_backend_reg_by_name(b"RPC")
    if not G._dream_rpc:
        raise native.NativeLibraryError("this build has no RPC backend (built with DREAMSTAGE_RPC=OFF)")
    return G


@functools.cache
def _proc(name: str, restype, *argtypes):
    """The RPC backend's function `name`, made once (traffic() is read around every decode batch)."""
    G = _ggml()
    addr = G.ggml_backend_reg_get_proc_address(G._dream_rpc, name.encode())
    if not addr:
        raise native.NativeLibraryError(f"the RPC backend has no {name} (a build without vendor/patches/0110-*?)")
    return ctypes.CFUNCTYPE(restype, *argtypes)(addr)


def connect(endpoints: tuple[Endpoint, ...], dead_after_s: float = DEAD_AFTER_S) -> list[int]:
    """Register each worker's devices with ggml (once per endpoint and process) and
    return their ggml device indices, in endpoint order; connections ggml makes from
    now on (the model's upload included) fail after `dead_after_s` of silence once their
    handshake is done. ValueError naming a worker that is not reachable."""
    for e in endpoints:     # (a registered worker too: a restarted one is connected again)
        if why := probe(e):
            raise ValueError(why)
    G = _ggml()
    _proc("dream_rpc_set_silence", None, ctypes.c_double)(dead_after_s)
    add_server = _proc("ggml_backend_rpc_add_server", ctypes.c_void_p, ctypes.c_char_p)
    out: list[int] = []
    failures = traffic().failures
    for e in endpoints:
        _connected_after[str(e)] = failures
        if str(e) not in _registered:
            reg = add_server(str(e).encode())
            if not reg:
                after = traffic()
                if after.failures > failures and after.last_failed == str(e):
                    raise ValueError(f"rpc worker {e} did not answer the RPC handshake: it stopped, or what listens "
                                     "there is not a dreamstage rpc-worker of this build")
                raise ValueError(f"rpc worker {e} reports no devices")
            # registering appends the worker's devices to ggml's list (their own
            # backend reg is the shared "RPC" one, so they are known by position)
            n = G.ggml_backend_dev_count()
            G.ggml_backend_register(reg)
            _registered[str(e)] = list(range(n, G.ggml_backend_dev_count()))
        out.extend(_registered[str(e)])
    return out


def model_devices(rpc_devices: list[int]):
    """The NULL-terminated ggml device list for llama_model_params.devices: the given
    RPC devices first (llama.cpp's order), then every local GPU; None (llama.cpp's own
    choice) while this process registered no worker."""
    if not _registered:
        return None
    G = _ggml()
    rpc = {i for ids in _registered.values() for i in ids}
    local = [i for i in range(G.ggml_backend_dev_count()) if i not in rpc and _is_gpu(G, i)]
    ids = list(rpc_devices) + local
    arr = (ctypes.c_void_p * (len(ids) + 1))(*[G.ggml_backend_dev_get(i) for i in ids], None)
    return arr


def _is_gpu(G, i: int) -> bool:
    # ggml_backend_dev_type: 0 CPU, 1 GPU, 2 IGPU, 3 ACCEL (llama.cpp offloads to GPU and IGPU)
    G.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    G.ggml_backend_dev_type.restype = ctypes.c_int
    return G.ggml_backend_dev_type(G.ggml_backend_dev_get(i)) in (1, 2)


@dataclass(frozen=True)
class Traffic:
    """What crossed the wire to and from every worker of this process so far."""
    sent: int
    received: int
    failures: int             # connections that failed (a worker gone)
    last_failed: str          # the endpoint of the last one ("" if none)

    @property
    def bytes(self) -> int:
        return self.sent + self.received


def traffic() -> Traffic:
    """The process's RPC byte counters (zeros in a build without the RPC backend)."""
    try:
        fn = _proc("dream_rpc_traffic", None, *([ctypes.POINTER(ctypes.c_uint64)] * 3), ctypes.c_char_p,
                   ctypes.c_size_t)
    except native.NativeLibraryError:
        return Traffic(0, 0, 0, "")
    s, r, f = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
    name = ctypes.create_string_buffer(256)
    fn(ctypes.byref(s), ctypes.byref(r), ctypes.byref(f), name, len(name))
    return Traffic(s.value, r.value, f.value, name.value.decode(errors="replace"))


def failed_worker(endpoints: tuple[str, ...]) -> str | None:
    """The worker among `endpoints` whose connection failed last in this process, or whose
    process closed this process's connection to it (`hung_up`), or None (the process
    remembers the last failed endpoint only)."""
    t = traffic()
    failed = t.last_failed in endpoints and t.failures > _connected_after.get(t.last_failed, 0)
    return t.last_failed if failed else hung_up(endpoints)


# Per endpoint, this process's connections to it when a model last loaded (`watch`), as
# (fd, socket inode): ggml's client learns that a worker is gone only when a command fails,
# and a decode that meets it first may need a new buffer's base, which the dropped command
# answers with NULL, and ggml asserts on. The kernel knows sooner: a worker whose process
# ended closed its side (ours waits in CLOSE_WAIT) or reset it (ours left the TCP table).
_watched: dict[str, set[tuple[int, int]]] = {}
_TCP_TABLE = Path("/proc/self/net/tcp")
_CLOSE_WAIT = "08"


def _tcp_rows() -> list[tuple[str, str, int]]:
    """(remote 'ip:port', state, inode) of each IPv4 TCP socket of this network namespace
    (Linux; empty elsewhere)."""
    try:
        lines = _TCP_TABLE.read_text().splitlines()[1:]
    except OSError:
        return []
    out = []
    for line in lines:
        f = line.split()
        if len(f) > 9:
            ip, port = f[2].split(":")
            out.append((f"{socket.inet_ntoa(bytes.fromhex(ip)[::-1])}:{int(port, 16)}", f[3], int(f[9])))
    return out


def _socket_inode(fd: int) -> int | None:
    """The inode of the socket open as `fd` in this process, or None (closed, or not a socket)."""
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return int(link[8:-1]) if link.startswith("socket:[") else None


def keep_alive(fd: int, dead_after_s: float) -> None:
    """Make the socket open as `fd` fail once its peer's host has answered nothing for about
    `dead_after_s`: TCP keepalive probes while it is idle, and a bound on unacknowledged sends
    (TCP_USER_TIMEOUT). (A live host whose worker process answers nothing is bounded by the
    hooks' receive and send deadline, set from `connect`.) Linux options; where one is
    missing the kernel's default stays."""
    idle = max(1, round(dead_after_s / 2))
    interval = max(1, round(dead_after_s / 6))
    # setsockopt on ggml's own descriptor (a Python socket object around it could change its
    # blocking mode, which the descriptor shares)
    libc = ctypes.CDLL(None, use_errno=True)
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    options += [(socket.IPPROTO_TCP, getattr(socket, name), value) for name, value in
                (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", 3),
                 ("TCP_USER_TIMEOUT", round(dead_after_s * 1000))) if hasattr(socket, name)]
    for level, name, value in options:
        v = ctypes.c_int(value)
        libc.setsockopt(fd, level, name, ctypes.byref(v), ctypes.sizeof(v))


def watch(endpoints: tuple[str, ...], dead_after_s: float = DEAD_AFTER_S) -> None:
    """Remember this process's connections to `endpoints` (call once a model has loaded),
    and make each fail when its worker's host vanishes (`keep_alive`)."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return
    ours = {inode: fd for fd in fds if (inode := _socket_inode(fd)) is not None}
    rows = _tcp_rows()
    for e in parse_endpoints(",".join(endpoints)):
        with contextlib.suppress(OSError):
            remote = f"{socket.gethostbyname(e.host)}:{e.port}"
            _watched[str(e)] = {(ours[i], i) for r, _, i in rows if r == remote and i in ours}
            for fd, _ in _watched[str(e)]:
                keep_alive(fd, dead_after_s)


def hung_up(endpoints: tuple[str, ...]) -> str | None:
    """The first of `endpoints` whose worker closed or reset a connection `watch` saw that
    this process still holds open, or None."""
    watched = [(e, _watched[e]) for e in endpoints if _watched.get(e)]
    if not watched:
        return None
    state = {i: s for _, s, i in _tcp_rows()}
    for e, conns in watched:
        held = [i for fd, i in conns if _socket_inode(fd) == i]   # ones ggml closed itself say nothing
        if any(state.get(i, _CLOSE_WAIT) == _CLOSE_WAIT for i in held):
            return e
    return None
