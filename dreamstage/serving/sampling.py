"""Sampling parameters and the llama.cpp sampler chain built from them.

The chain is built and freed on the engine thread (it is a llama object).
Order follows llama.cpp's common sampler: grammar first (it masks whole
tokens), then penalties, the truncating filters, temperature, and finally the
seeded draw. Temperature 0 means greedy: no filters, no draw, argmax.
"""
from __future__ import annotations

import ctypes
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from dreamstage import native


class GrammarError(ValueError):
    """A grammar or JSON schema that llama.cpp could not compile."""


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling. The defaults are llama-server's (its common
    sampling parameters), so a request that sets nothing samples as it would
    there; a GGUF's own generation settings replace them (model_defaults)."""
    temperature: float = 0.8
    top_k: int = 40             # 0: off
    top_p: float = 0.95         # 1.0: off
    min_p: float = 0.05         # 0.0: off
    typical_p: float = 1.0      # 1.0: off (locally typical sampling)
    repeat_penalty: float = 1.0
    penalty_last_n: int = 64    # generated tokens the penalties look back over (0: none)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None     # None: a fresh random seed per request
    grammar: str | None = None  # GBNF, root rule "root"

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


# GGUF keys of a model's recommended generation settings (llama.cpp's
# general.sampling.*) and the SamplingParams field each one sets.
GGUF_SAMPLING_KEYS = {"general.sampling.temp": ("temperature", float), "general.sampling.top_k": ("top_k", int),
                      "general.sampling.top_p": ("top_p", float), "general.sampling.min_p": ("min_p", float),
                      "general.sampling.penalty_repeat": ("repeat_penalty", float),
                      "general.sampling.penalty_last_n": ("penalty_last_n", int)}


def model_defaults(meta: Callable[[str], str | None]) -> SamplingParams:
    """The sampling defaults for a model: its GGUF's general.sampling.* values
    where present (and readable), llama-server's for the rest.
    `meta(key)` returns a metadata value as text, or None."""
    given: dict[str, Any] = {}
    for key, (name, kind) in GGUF_SAMPLING_KEYS.items():
        text = meta(key)
        if text is None:
            continue
        try:
            given[name] = kind(float(text)) if kind is int else kind(text)
        except ValueError:
            continue
    return replace(SamplingParams(), **given)


def json_schema_grammar(schema: dict | None) -> str:
    """GBNF for a JSON schema (or any JSON value when schema is None)."""
    from llama_cpp import llama_grammar  # bound to our lib via native

    native.llama_cpp()
    if schema is None:
        return llama_grammar.JSON_GBNF
    try:
        return llama_grammar.json_schema_to_gbnf(json.dumps(schema))
    except Exception as e:  # the converter raises plain Exceptions
        raise GrammarError(f"JSON schema could not be converted to a grammar: {e}") from e


def build_chain(vocab, n_vocab: int, p: SamplingParams):
    """A new sampler chain (caller frees with llama_sampler_free)."""
    lc = native.llama_cpp()
    params = lc.llama_sampler_chain_default_params()
    params.no_perf = True
    chain = lc.llama_sampler_chain_init(params)
    add = lc.llama_sampler_chain_add
    if p.grammar:
        g = lc.llama_sampler_init_grammar(vocab, p.grammar.encode("utf-8"), b"root")
        if not g:
            lc.llama_sampler_free(chain)
            raise GrammarError("grammar could not be parsed by llama.cpp "
                               "(check the GBNF; the root rule must be named 'root')")
        add(chain, g)
    if p.repeat_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
        add(chain, lc.llama_sampler_init_penalties(n_vocab, p.penalty_last_n, p.repeat_penalty,
                                                   p.frequency_penalty, p.presence_penalty))
    if p.greedy:
        add(chain, lc.llama_sampler_init_greedy())
        return chain
    if p.top_k > 0:
        add(chain, lc.llama_sampler_init_top_k(p.top_k))
    if p.top_p < 1.0:
        add(chain, lc.llama_sampler_init_top_p(p.top_p, 1))
    if p.typical_p < 1.0:
        add(chain, lc.llama_sampler_init_typical(p.typical_p, 1))
    if p.min_p > 0.0:
        add(chain, lc.llama_sampler_init_min_p(p.min_p, 1))
    add(chain, lc.llama_sampler_init_temp(p.temperature))
    seed = lc.LLAMA_DEFAULT_SEED if p.seed is None else ctypes.c_uint32(p.seed).value
    add(chain, lc.llama_sampler_init_dist(seed))
    return chain
