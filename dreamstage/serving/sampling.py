"""Sampling parameters and the llama.cpp sampler chain built from them.

The chain is built and freed on the engine thread (it is a llama object).
Order: grammar first (it masks whole tokens), then logit bias and penalties
(llama.cpp's common sampler has them in that order), the truncating filters,
temperature, and finally the seeded draw. Temperature 0 means greedy: no
filters, no draw, argmax. Logprobs are read between penalties and truncation.
"""
from __future__ import annotations

import ctypes
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dreamstage import native


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probability (natural log) of `token`, and the `top` (token, logprob) pairs."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class GrammarError(ValueError):
    """A grammar or JSON schema that llama.cpp could not compile."""


class GrammarDeadEnd(GrammarError):
    """The grammar allows no token of the vocabulary at this point of the answer."""


# What a banned token's logit becomes (logit_bias -100 or false, min_tokens): below any real logit, so
# never drawn while any other token is allowed, but finite. Where a grammar allows only banned tokens
# one of them is drawn; at -inf nothing is left and llama.cpp's grammar aborts the process.
BANNED_LOGIT = -1e30


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
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token, bias) added to the logits; BANNED_LOGIT bans
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


def gguf_sampling(meta: Callable[[str], str | None]) -> dict[str, Any]:
    """The SamplingParams fields a GGUF's general.sampling.* values set (readable ones only).
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
    return given


def model_defaults(meta: Callable[[str], str | None]) -> SamplingParams:
    """The sampling defaults for a model: its GGUF's general.sampling.* values
    where present (and readable), llama-server's for the rest."""
    return replace(SamplingParams(), **gguf_sampling(meta))


def defaults_source(meta: Callable[[str], str | None]) -> str:
    """Where model_defaults' values come from, in words (`/props`, `/slots`, `dreamstage info`)."""
    given = gguf_sampling(meta)
    if not given:
        return "llama-server's (the GGUF has no general.sampling.* values)"
    return f"the GGUF's general.sampling.* for {', '.join(given)}; llama-server's for the rest"


def json_schema_grammar(schema: dict | None) -> str:
    """GBNF for a JSON schema (or any JSON value when schema is None)."""
    from llama_cpp import llama_grammar  # bound to our lib via native

    native.llama_cpp()
    if schema is None:
        return llama_grammar.JSON_GBNF
    try:
        gbnf = llama_grammar.json_schema_to_gbnf(json.dumps(schema))
    except Exception as e:  # the converter raises plain Exceptions
        raise GrammarError(f"JSON schema could not be converted to a grammar: {e}") from e
    # The converter's string character admits raw control characters, which JSON does not (a newline
    # inside a string made json.loads fail): the rule JSON_GBNF's strings use instead.
    return _LOOSE_CHAR.sub(lambda m: m.group(1) + _JSON_CHAR, gbnf)


_LOOSE_CHAR = re.compile(r'^(char ::= )\[\^"\\\\\]', re.MULTILINE)    # the rule's `char ::= [^"\\]`
_JSON_CHAR = r'[^"\\\x7F\x00-\x1F]'


def _pre_stage(lc, chain, vocab, n_vocab: int, p: SamplingParams) -> None:
    """What the reported distribution has been through: grammar, logit bias, penalties."""
    add = lc.llama_sampler_chain_add
    if p.grammar:
        g = lc.llama_sampler_init_grammar(vocab, p.grammar.encode("utf-8"), b"root")
        if not g:
            raise GrammarError("grammar could not be parsed by llama.cpp "
                               "(check the GBNF; the root rule must be named 'root')")
        add(chain, g)
    if p.logit_bias:
        biases = (lc.llama_logit_bias * len(p.logit_bias))(*(lc.llama_logit_bias(t, b) for t, b in p.logit_bias))
        add(chain, lc.llama_sampler_init_logit_bias(n_vocab, len(p.logit_bias), biases))
    if p.repeat_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
        add(chain, lc.llama_sampler_init_penalties(n_vocab, p.penalty_last_n, p.repeat_penalty,
                                                   p.frequency_penalty, p.presence_penalty))


def _post_stage(lc, chain, p: SamplingParams) -> None:
    """Truncation, temperature and the draw (or argmax at temperature 0)."""
    add = lc.llama_sampler_chain_add
    if p.greedy:
        add(chain, lc.llama_sampler_init_greedy())
        return
    if p.top_k > 0:
        add(chain, lc.llama_sampler_init_top_k(p.top_k))
    if p.typical_p < 1.0:
        add(chain, lc.llama_sampler_init_typical(p.typical_p, 1))
    if p.top_p < 1.0:
        add(chain, lc.llama_sampler_init_top_p(p.top_p, 1))
    if p.min_p > 0.0:
        add(chain, lc.llama_sampler_init_min_p(p.min_p, 1))
    add(chain, lc.llama_sampler_init_temp(p.temperature))
    seed = lc.LLAMA_DEFAULT_SEED if p.seed is None else ctypes.c_uint32(p.seed).value
    add(chain, lc.llama_sampler_init_dist(seed))


def _new_chain(lc):
    params = lc.llama_sampler_chain_default_params()
    params.no_perf = True
    return lc.llama_sampler_chain_init(params)


class Sampler:
    """One request's llama.cpp sampler chain, built and freed on the engine thread.

    Two stages, each a chain, both owned by one outer chain: `pre` (grammar,
    logit bias, penalties) and `post` (truncation, temperature, the draw).
    `sample` runs them as one; `sample_scored` reads the distribution between
    them, which is what logprobs report: after penalties and bias, before
    temperature and truncation. Both draw the same token for the same state."""

    def __init__(self, vocab, n_vocab: int, p: SamplingParams):
        lc = self.lc = native.llama_cpp()
        self.n_vocab = n_vocab
        self.chain = _new_chain(lc)
        self.pre, self.post = _new_chain(lc), _new_chain(lc)
        lc.llama_sampler_chain_add(self.chain, self.pre)     # the outer chain owns (and frees) both
        lc.llama_sampler_chain_add(self.chain, self.post)
        try:
            _pre_stage(lc, self.pre, vocab, n_vocab, p)
            _post_stage(lc, self.post, p)
        except BaseException:
            self.free()
            raise
        self._cells = np.zeros(n_vocab, dtype=_TOKEN_DATA)
        # A grammar can reach a point no token continues; drawn from nothing, llama.cpp's grammar then
        # aborts the process. Such a chain samples in two stages and checks between them.
        self._checked = p.grammar is not None

    def sample(self, ctx, idx: int) -> int:
        """The drawn token (accepted by the chain). Raises GrammarDeadEnd where the grammar allows none."""
        if not self._checked:
            return self.lc.llama_sampler_sample(self.chain, ctx, idx)
        cur, _ = self._staged(ctx, idx)
        return self._draw(cur)

    def sample_scored(self, ctx, idx: int, top_n: int) -> tuple[int, TokenLogprob]:
        """The drawn token and its log-probability (with the top_n most likely) under the pre stage's distribution."""
        cur, staged = self._staged(ctx, idx)
        logprobs = log_softmax(staged["logit"].astype(np.float64))
        ids = staged["id"].copy()
        token = self._draw(cur)
        return token, scored(ids, logprobs, token, top_n)

    def _staged(self, ctx, idx: int):
        """Row idx's candidates through the pre stage: (the llama_token_data_array, a view of its cells)."""
        lc, n = self.lc, self.n_vocab
        cells = self._cells
        cells["id"] = np.arange(n, dtype=np.int32)
        cells["logit"] = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, idx), shape=(n,))
        cells["p"] = 0.0
        cur = lc.llama_token_data_array(cells.ctypes.data_as(lc.llama_token_data_p), n, -1, False)
        lc.llama_sampler_apply(self.pre, ctypes.byref(cur))
        staged = _cells_of(cur)
        if not np.isfinite(staged["logit"]).any():
            raise GrammarDeadEnd("the grammar allows no token of the vocabulary here, so the answer cannot go on")
        return cur, staged

    def _draw(self, cur) -> int:
        self.lc.llama_sampler_apply(self.post, ctypes.byref(cur))
        token = int(cur.data[cur.selected].id)
        self.lc.llama_sampler_accept(self.chain, token)
        return token

    def free(self) -> None:
        if self.chain is not None:
            self.lc.llama_sampler_free(self.chain)
        self.chain = self.pre = self.post = None


# llama_token_data: {llama_token id; float logit; float p}
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


def _cells_of(cur) -> np.ndarray:
    # a sampler may point `data` elsewhere; read whatever it points at now
    addr = ctypes.cast(cur.data, ctypes.c_void_p).value or 0
    raw = (ctypes.c_char * (cur.size * _TOKEN_DATA.itemsize)).from_address(addr)
    return np.frombuffer(raw, dtype=_TOKEN_DATA, count=cur.size)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Natural-log probabilities of float64 logits; -inf logits (masked tokens) stay -inf."""
    finite = logits[np.isfinite(logits)]
    if not finite.size:                  # every token masked: none has a probability
        return np.full(logits.shape, -np.inf)
    shifted = logits - finite.max()
    return shifted - np.log(np.exp(shifted).sum())


def scored(ids: np.ndarray, logprobs: np.ndarray, token: int, top_n: int) -> TokenLogprob:
    """`token`'s log-probability and the top_n finite ones, most likely first (ties by id)."""
    where = np.nonzero(ids == token)[0]
    own = float(logprobs[where[0]]) if where.size else float("-inf")
    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        k = min(top_n, logprobs.size)
        part = np.argpartition(-logprobs, k - 1)[:k]
        order = sorted(part, key=lambda i: (-logprobs[i], ids[i]))
        top = tuple((int(ids[i]), float(logprobs[i])) for i in order if np.isfinite(logprobs[i]))
    return TokenLogprob(token, own, top)
