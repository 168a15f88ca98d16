"""Drift: how far a job's adapter moves the model on prompts the job never taught.

The base's records of the anchors (records.py: its greedy answer and, at each
of its tokens, the top TOP_K log-probabilities plus the mass of the rest) are
decoded once more, teacher-forced, with the job's adapter on, after (and
during) training, and two figures come out:

- `drift_kl`: the mean over all recorded anchor tokens of KL(base || adapter),
  the base's distribution against the adapter's at the same position;
- `anchors_changed_raw`: the fraction of anchors whose greedy answer changed.
  Greedy decoding is deterministic, so the adapter's greedy answer equals the
  base's exactly when, at every position of the base's answer, the adapter's
  argmax is the base's token. One teacher-forced decode per anchor decides it
  (no generation with the adapter on).
- `anchors_changed`: the same, counting only the positions where the base's
  top token led its second by more than the probe's `noise_margin`: the
  widest drop of the base token's lead that adapters which learned nothing
  (B ~ N(0, NULL_SIGMA^2)) made at any position of the same anchors
  (`DriftProbe.null_margin`, `lead_drops`). On a quantized model a
  perturbation of any size flips the base's near ties (the CPU backend's
  8-bit activations); those flips are the measurement's noise, not the job's.
  Without a noise margin both figures are the same.

Every probe step makes llama calls on the resident context, so it runs on the
engine thread, between decode batches, on a sequence no slot is using, in
units (decoding.Decoder), as many per engine step as fit the step's time, so a
waiting request waits about one unit, not one anchor.
"""
from __future__ import annotations

import math
import time
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dreamstage.training.drift.decoding import PIECE_TOKENS, Decoder, FixedSequence, log_softmax, set_context_adapter
from dreamstage.training.drift.neighbours import MAX_JOB_NEIGHBOURS, NEIGHBOUR_TOKENS, neighbour_units, plain_words
from dreamstage.training.drift.records import ANCHOR_TOKENS, AnchorBase, prompt_tokens, record_units
from dreamstage.training.walk.examples import ChatRenderer

# The decode time one step of a probe aims at (at least one unit runs) when
# the job sets no pause bound; the guard passes half the job's max_pause_ms.
DEFAULT_STEP_MS = 100.0
# The adapters that learned nothing, whose lead drops set a probe's noise
# margin: the job's A, each B drawn from N(0, NULL_SIGMA^2), NULL_DRAWS draws
# seeded by NULL_SEED. Sigma is far below any trained B (the flips do not
# depend on it: bench/bench_drift_floor.py). The margin is the NULL_RANK-th
# widest of the draws' widest drops, so a further null adapter's exceeds it
# with probability NULL_RANK / (NULL_DRAWS + 1), 10 %, and no single draw sets it.
NULL_SIGMA = 1e-4
NULL_DRAWS = 19
NULL_RANK = 2
NULL_SEED = 7


@dataclass(frozen=True)
class Drift:
    """Drift figures of one adapter against the base records."""

    drift_kl: float                     # mean KL(base || adapter) over the anchors' answer tokens, nats
    anchors_changed: float              # fraction of anchors whose answer changed beyond the noise margin
    changed: int
    anchors: int
    tokens: int
    # per anchor: the first answer token where the greedy answer changed, or None
    first_change: tuple[int | None, ...] = ()
    ms: float = 0.0                     # the measurement's decodes (not the serving between them)
    # the fraction (and count) of anchors whose greedy answer changed at all, near ties
    # included; the same as anchors_changed when no noise margin was measured (None)
    anchors_changed_raw: float | None = None
    changed_raw: int | None = None
    noise_margin: float | None = None
    # per anchor: the base's lead (log p1 - log p2) at every answer position the adapter's argmax left
    flip_leads: tuple[tuple[float, ...], ...] = ()
    # per anchor: the lead drop at every answer position (lead_drops), nats
    drops: tuple[tuple[float, ...], ...] = ()
    # per anchor: its prompt (what changed_anchors names)
    prompts: tuple[str, ...] = ()
    # the widest lead drop of each null adapter the noise margin was read from, in draw order
    noise_draws: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.changed_raw is None:
            object.__setattr__(self, "changed_raw", self.changed)
            object.__setattr__(self, "anchors_changed_raw", self.anchors_changed)

    @property
    def widest_drop(self) -> float:
        """The widest lead drop at any answer position of any anchor (0.0 when none fell), nats."""
        return max([0.0, *(x for d in self.drops for x in d)])

    def as_dict(self) -> dict[str, Any]:
        return {"drift_kl": self.drift_kl, "anchors_changed": self.anchors_changed, "anchors": self.anchors,
                "anchors_changed_count": self.changed, "anchor_tokens": self.tokens,
                "anchors_changed_raw": self.anchors_changed_raw, "anchors_changed_raw_count": self.changed_raw,
                "noise_margin": self.noise_margin, "noise_draws": [round(x, 4) for x in self.noise_draws],
                "changed_anchors": self.changed_anchors()}

    def changed_anchors(self) -> list[dict[str, Any]]:
        """Every anchor whose greedy answer changed at all, widest first: its prompt,
        `lead` (the widest base lead at which the adapter's argmax left the base's
        token: the anchor counts in anchors_changed when it exceeds the noise margin),
        `first` (the first answer token that changed) and `beyond` (whether it counts)."""
        out = []
        for i, (leads, first) in enumerate(zip(self.flip_leads, self.first_change, strict=False)):
            if first is None:
                continue
            lead = max(leads, default=0.0)
            out.append({"anchor": self.prompts[i] if i < len(self.prompts) else None, "lead": round(lead, 4),
                        "first": first,
                        "beyond": self.noise_margin is None or any(x > self.noise_margin for x in leads)})
        return sorted(out, key=lambda a: -a["lead"])


def summary_of(figures: dict[str, Any]) -> str:
    """One line of a measurement's figures (Drift.as_dict) for a job's message."""
    beyond = ""
    if figures.get("noise_margin") is not None:
        beyond = (f" beyond the noise margin {figures['noise_margin']:.3f} (at all: "
                  f"{figures['anchors_changed_raw_count']}/{figures['anchors']})")
    partial = ""
    if figures.get("anchors_recorded") is not None:
        partial = " (of the {} of {} anchors recorded so far)".format(*figures["anchors_recorded"])
    return (f"anchors_changed {figures['anchors_changed']:.3f} ({figures['anchors_changed_count']}/"
            f"{figures['anchors']}){beyond}, drift_kl {figures['drift_kl']:.4f}{partial}")


def summary(drift: Drift) -> str:
    return summary_of(drift.as_dict())


def drift_units(resident, seq_id: int, base: AnchorBase, kept: int = 0, keep: int = 0
                ) -> Generator[None, None, tuple[float, int, int | None, tuple[float, ...], np.ndarray]]:
    """(sum of KL(base || now) over the answer's tokens, tokens, the first answer token the
    greedy answer changes at or None, the base's lead at every position the argmax
    changes at, the lead drop at every answer position: how far the base token's lead
    over every other token fell, lead_drops) for whatever adapter the context has on
    during the units. `kept` and `keep`: Decoder.forced_units."""
    n = len(base.answer)
    dec = Decoder(resident, seq_id)
    try:
        rows = yield from dec.forced_units(base.forced, len(base.prompt_tokens) - 1, kept, keep)
    finally:
        dec.close()
    logq = log_softmax(rows[:n])
    diff = np.flatnonzero(logq.argmax(axis=1) != np.asarray(base.answer))
    first = int(diff[0]) if diff.size else None
    lp = base.top_logp.astype(np.float64)
    lq = np.take_along_axis(logq, base.top_ids.astype(np.int64), axis=1)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=1)
    q_rest = np.clip(1.0 - np.exp(lq).sum(axis=1), 1e-30, None)
    has_tail = np.isfinite(base.tail_logp)
    lt = np.where(has_tail, base.tail_logp, 0.0)
    kl += np.where(has_tail, np.exp(lt) * (lt - np.log(q_rest)), 0.0)
    base_leads = base.leads()
    leads = tuple(float(x) for x in base_leads[diff])
    drops = lead_drops(base_leads, logq, base.answer)
    # a coarsened KL is >= 0; float error at identical distributions may dip below
    return float(np.clip(kl, 0.0, None).sum()), n, first, leads, drops


def reply_lead_units(resident, seq_id: int, tokens: Sequence[int], mask: Sequence[int]
                     ) -> Generator[None, None, float]:
    """The smallest lead, over a training window's trained positions, of the
    token trained there over the best other token (log-probabilities, nats),
    for whatever adapter the context has on during the units: one
    teacher-forced decode of the window in the records' fixed pieces. Above 0
    exactly when every trained token is the greedy choice after the tokens
    before it, so a reply is answered at temperature 0 as it was taught (up
    to the rounding a serving batch of another shape adds). A mean loss
    cannot say that: one token the model no longer prefers is a small share
    of a reply's loss, and a greedy answer turns on it."""
    trained = [t for t, m in enumerate(mask) if m]
    if not trained or trained[0] < 1:
        raise ValueError("a window needs a trained position after its first token")
    first = trained[0] - 1
    dec = Decoder(resident, seq_id)
    try:
        rows = yield from dec.forced_units(tokens[:trained[-1]], first)
    finally:
        dec.close()
    lead = math.inf
    for t in trained:
        row = rows[t - 1 - first]
        own = row[tokens[t]]
        row = row.copy()
        row[tokens[t]] = -np.inf
        lead = min(lead, float(own - row.max()))
    return lead


def lead_drops(base_leads: np.ndarray, logq: np.ndarray, answer: Sequence[int]) -> np.ndarray:
    """At each answer position, how far the base token's lead over every other token
    fell: the base's lead (log p1 - log p2) less the lead of the same token under
    `logq` (its log-probability less the best other's; negative where the argmax
    left it). The argmax leaves the base token exactly where the drop exceeds the
    base's lead, so the widest drop a null adapter makes anywhere bounds the
    leads its rounding could cross, near tie or not (DriftProbe.null_margin)."""
    pos = np.arange(len(answer))
    own = logq[pos, np.asarray(answer)]
    other = logq.copy()
    other[pos, np.asarray(answer)] = -np.inf
    return base_leads - (own - other.max(axis=1))


class DriftProbe:
    """The base records of one job's anchors and the drift measurement, in engine steps.

    `record()` and `measure()` are generators; the generator's return value is
    the result. Each `next()` is one engine step: it decodes units of one
    anchor (a piece of PIECE_TOKENS teacher-forced tokens, or one generated
    token) while they fit `step_ms` (at least one), with the measured adapter
    (or none) on the context, after `enter()` (serving's adapters step aside),
    and puts serving's adapter back (`restore`) before it returns. An
    anchor's units run on a sequence held across steps:
    `seq_id` is an int (a sequence the caller owns) or a callable that lends
    one (`Engine.hold_idle_sequence`: a lease, or None while every slot is
    busy, and the step waits). Serving takes a lent sequence back whenever it
    needs the slot; the anchor then starts again on the next lease
    (`restarts` counts those). `samples`: continuations sampled per anchor at
    recording (the regularizer's rehearsal anchors; none for measured ones).
    `turn`: a one-item list shared by the probes that lend the same sequence
    (a guard's): it names the anchor that decoded on it last, and an anchor
    whose decodes another one's came between starts again, as after a loan ended.
    Within one `measure()` the anchors share their prompts' common head: the
    whole pieces before its first measured row that an anchor's tokens share
    with the anchor before it, on the same sequence with nothing between, are
    not decoded again (the chat template's system turn; the same arithmetic, so
    the figures are bit-identical to decoding each anchor whole).
    """

    def __init__(self, resident, prompts: Sequence[str], *, seq_id, restore=lambda: None, enter=lambda: None,
                 renderer: ChatRenderer | None = None, step_ms: float | None = DEFAULT_STEP_MS, samples: int = 0,
                 turn: list | None = None, share_head: bool = True):
        if not prompts:
            raise ValueError("a drift probe needs at least one anchor prompt")
        if step_ms is not None and not step_ms > 0:
            raise ValueError(f"step_ms {step_ms!r} must be > 0")
        self.resident = resident
        self.prompts = list(prompts)
        self.lend = seq_id if callable(seq_id) else (lambda: FixedSequence(seq_id))
        self.restore, self.enter = restore, enter
        self.renderer = renderer or ChatRenderer(resident)
        self.step_s = step_ms / 1000.0 if step_ms is not None else math.inf
        self.samples = samples
        self.bases: list[AnchorBase] = []
        # flips at a base lead at most this wide are not counted in anchors_changed (None: all are)
        self.noise_margin: float | None = None
        self.noise_draws: tuple[float, ...] = ()   # each null draw's widest drop (null_margin)
        self.anchor_ms: float | None = None     # the recent cost of measuring one anchor (a running mean)
        self.restarts = 0                       # anchors started again after serving took the sequence back
        self._lease: Any = None
        self._turn = turn if turn is not None else [None]
        # what the held sequence keeps from the last measured anchor: (its lease, its turn,
        # the adapter, the tokens at positions 0 ..); None when it keeps nothing
        self._head: tuple[Any, object, Any, tuple[int, ...]] | None = None
        self.share_head = share_head            # False: every anchor is decoded whole (the reference)

    def _held(self, cells: int, keep: int = 0) -> Generator[None, None, tuple[Any, int]]:
        # (a lease with room reserved for `cells` positions: a unified K/V pool may have none
        # yet, and what it keeps of positions 0 .. keep-1: `keep` on the lease held, 0 on a new one)
        while True:
            if self._lease is None or not self._lease.valid:
                got = self.lend()
                self._lease = FixedSequence(got) if isinstance(got, int) else got
                keep = 0
            if self._lease is not None and self._lease.reserve(cells, keep):
                return self._lease, keep
            keep = 0                                   # a refused reservation drops what was kept
            yield

    def _give_back(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None and lease.valid:
            Decoder(self.resident, lease.seq_id).clear()   # a kept head, or an anchor stopped mid-way
            lease.release()
        self._head = None

    def _kept_head(self, adapter, tokens: Sequence[int], first_row: int) -> int:
        """Positions of `tokens` whose K/V the held sequence has under `adapter` from the
        anchor measured last, with nothing decoded on it since: whole pieces before first_row."""
        head = self._head
        if head is None or head[0] is not self._lease or head[1] is not self._turn[0] or head[2] != adapter:
            return 0
        same = 0
        for a, b in zip(head[3], tokens[:first_row], strict=False):
            if a != b:
                break
            same += 1
        return same - same % PIECE_TOKENS

    def _anchor(self, units_on, adapter, cells: int,
                head: tuple[Sequence[int], int] | None = None) -> Generator[None, None, tuple[Any, float]]:
        """One anchor's units (`units_on(seq_id)`, or with `head`, the anchor's tokens and
        its first measured row: `units_on(seq_id, kept, keep)`, Decoder.forced_units), as
        many per step as fit step_s, on the held sequence, which they fill to at most
        `cells` positions; (its result, its decode ms)."""
        ms, mine = 0.0, object()
        kept = self._kept_head(adapter, *head) if head is not None else 0
        self._head = None
        keep = head[1] - head[1] % PIECE_TOKENS if head is not None else 0
        while True:
            lease, kept = yield from self._held(cells, kept)
            units = units_on(lease.seq_id, kept, keep) if head is not None else units_on(lease.seq_id)
            kept = 0                                   # a start again decodes every piece
            self._turn[0] = mine
            try:
                while True:
                    t0 = time.perf_counter()
                    self.enter()
                    set_context_adapter(self.resident, adapter)
                    try:
                        while True:
                            u0 = time.perf_counter()
                            try:
                                next(units)
                            except StopIteration as stop:
                                if head is not None and keep:
                                    self._head = (lease, mine, adapter, tuple(head[0][:keep]))
                                return stop.value, ms + (time.perf_counter() - t0) * 1000.0
                            now = time.perf_counter()
                            if (now - t0) + (now - u0) > self.step_s:
                                break
                    finally:
                        self.restore()
                    ms += (time.perf_counter() - t0) * 1000.0
                    yield
                    if not lease.valid or self._turn[0] is not mine:   # serving or another anchor took it
                        self.restarts += 1
                        break
            finally:
                units.close()

    def record(self, cache: dict | None = None) -> Generator[None, None, None]:
        """Records every anchor with the adapter off. `cache` maps prompt -> AnchorBase
        across jobs (the base model does not change while the process lives);
        a cached record with fewer samples than this probe wants is made again."""
        out = []
        try:
            for prompt in self.prompts:
                out.append((yield from self.record_prompt(prompt, cache)))
        finally:
            self._give_back()
        self.bases = out

    def record_prompt(self, prompt: str, cache: dict | None = None) -> Generator[None, None, AnchorBase]:
        """One anchor's record (from `cache` when it holds one with enough samples,
        without a step), cached; the lease stays held for the next (give it back
        with `release`)."""
        if cache is not None and prompt in cache and len(cache[prompt].samples) >= self.samples:
            return cache[prompt]
        toks = prompt_tokens(self.resident, prompt, self.renderer)
        base, _ = yield from self._anchor(
            lambda s: record_units(self.resident, s, prompt, toks, samples=self.samples), None,
            len(toks) + ANCHOR_TOKENS)
        if cache is not None:
            cache[prompt] = base
        yield
        return base

    def release(self) -> None:
        """Give the lent sequence back (record_prompt keeps it between anchors)."""
        self._give_back()

    def neighbours_of(self, questions: Sequence[str], n: int, cache: dict | None = None,
                      exclude: Iterable[str] = ()) -> Generator[None, None, list[str]]:
        """The base's neighbours of each of `questions` (neighbour_units, adapter
        off), in order, without duplicates, at most MAX_JOB_NEIGHBOURS; `cache` maps
        (question, n) -> its neighbours across jobs. A neighbour that is, or
        begins with, one of `exclude` (the measured anchors: never trained) up
        to case, spacing and punctuation is left out (plain_words)."""
        shut = [plain_words(x) for x in exclude]
        out: list[str] = []
        try:
            for q in questions:
                if len(out) >= MAX_JOB_NEIGHBOURS:
                    break
                key = (q, n)
                if cache is not None and key in cache:
                    got = cache[key]
                else:
                    got, _ = yield from self._anchor(
                        lambda s, q=q: neighbour_units(self.resident, s, q, self.renderer, n), None,
                        sum(map(len, self.renderer.user_turn(q))) + NEIGHBOUR_TOKENS)
                    if cache is not None:
                        cache[key] = got
                    yield
                out.extend(x for x in got if x not in out and not any(plain_words(x).startswith(m) for m in shut))
        finally:
            self._give_back()
        return out[:MAX_JOB_NEIGHBOURS]

    def measure(self, adapter_handle, indices: Sequence[int] | None = None) -> Generator[None, None, Drift]:
        """Drift of `adapter_handle` (a llama_adapter_lora, or its address)
        against the records of every anchor, or of those at `indices`; returns a Drift."""
        if not self.bases:
            raise RuntimeError("record() the base answers before measuring drift")
        kl_sum, tokens, first, leads, ms, drops, prompts = 0.0, 0, [], [], 0.0, [], []
        self._head = None                              # the adapter's weights may have changed since
        try:
            for base in (self.bases if indices is None else [self.bases[i] for i in indices]):
                prompts.append(base.prompt)
                (kl, n, f, lead, d), one = yield from self._anchor(
                    lambda s, kept=0, keep=0, b=base: drift_units(self.resident, s, b, kept, keep), adapter_handle,
                    len(base.forced), head=(base.forced, len(base.prompt_tokens) - 1) if self.share_head else None)
                ms += one
                self.anchor_ms = one if self.anchor_ms is None else 0.5 * (self.anchor_ms + one)
                kl_sum, tokens = kl_sum + kl, tokens + n
                first.append(f)
                leads.append(lead)
                drops.append(tuple(float(x) for x in d))
                yield
        finally:
            self._give_back()
        raw = sum(f is not None for f in first)
        margin = self.noise_margin
        changed = raw if margin is None else sum(any(x > margin for x in lead) for lead in leads)
        return Drift(drift_kl=kl_sum / tokens if tokens else 0.0, anchors_changed=changed / len(first),
                     changed=changed, anchors=len(first), tokens=tokens, first_change=tuple(first), ms=ms,
                     anchors_changed_raw=raw / len(first), changed_raw=raw, noise_margin=margin,
                     flip_leads=tuple(leads), drops=tuple(drops), prompts=tuple(prompts),
                     noise_draws=tuple(self.noise_draws) if margin is not None else ())

    def reply_leads(self, adapter_handle, windows: Sequence[Any]) -> Generator[None, None, list[float]]:
        """reply_lead_units of each of `windows` (TrainWindows: tokens and mask)
        with `adapter_handle` on the context, in short steps; one lead a window."""
        out = []
        try:
            for w in windows:
                lead, _ = yield from self._anchor(
                    lambda s, w=w: reply_lead_units(self.resident, s, w.tokens, w.mask), adapter_handle,
                    len(w.tokens))
                out.append(lead)
                yield
        finally:
            self._give_back()
        return out

    def null_margin(self, trainer, draws: int = NULL_DRAWS, sigma: float = NULL_SIGMA,
                    seed: int = NULL_SEED) -> Generator[None, None, float]:
        """The noise margin of these records (sets `noise_margin`, and returns it): how
        far an adapter that learned nothing lowers a lead (lead_drops) at any answer
        position of any anchor, the NULL_RANK-th widest such drop of `draws` such
        adapters (noise_margin_of): `trainer`'s shadow adapter
        with its A as it is and every B drawn from N(0, sigma^2). A null adapter's
        argmax leaves the base token only where its drop exceeds the base's lead, so
        a draw's widest drop is never below the widest lead its flips crossed; it reads every
        position, not only the near ties a draw happened to cross, which makes it the
        reach of the rounding noise rather than of the few flips it made
        (docs/architecture/drift.md, "The noise margin"). The shadow adapter is put
        back as it was (B = 0 at a job's start). 0.0 when no null adapter lowered any
        lead: every flip counts."""
        if not self.bases:
            raise RuntimeError("record() the base answers before measuring the noise margin")
        self.noise_margin, self.noise_draws = None, ()
        return self.adopt_nulls((yield from self.null_drifts(trainer, draws, sigma, seed)))

    def adopt_nulls(self, nulls: Sequence[Drift]) -> float:
        """Sets (and returns) the noise margin the null adapters' figures give (noise_margin_of)."""
        self.noise_draws = tuple(n.widest_drop for n in nulls)
        self.noise_margin = noise_margin_of(nulls)
        return self.noise_margin

    def null_drifts(self, trainer, draws: int = NULL_DRAWS, sigma: float = NULL_SIGMA,
                    seed: int = NULL_SEED, around: bool = False) -> Generator[None, None, list[Drift]]:
        """The figures of `draws` adapters that learned nothing, one Drift each:
        `trainer`'s shadow adapter with its A as it is and every B drawn from
        N(0, sigma^2), draw d seeded by (seed, d); the shadow adapter is put back
        as it was (null_margin reads their lead drops). `around`: the noise is
        added to the B it has instead (the rounding's reach around a trained
        adapter, as the null draws are around the base; bench_drift --jitters)."""
        before = trainer.lora_parameters()
        out = []
        try:
            for vec in null_vectors(trainer, before, draws, sigma, seed, around):
                trainer.set_lora_parameters(vec)
                trainer.promote()
                out.append((yield from self.measure(trainer.served_adapter)))
        finally:
            trainer.set_lora_parameters(before)
            trainer.promote()
        return out


def null_vectors(trainer, start: np.ndarray, draws: int = NULL_DRAWS, sigma: float = NULL_SIGMA,
                 seed: int = NULL_SEED, around: bool = False) -> Iterator[np.ndarray]:
    """The parameters of `draws` adapters that learned nothing: `start` (trainer's
    flat order) with every B drawn from N(0, sigma^2), draw d seeded by (seed, d);
    `around`: the noise added to start's B instead."""
    is_b = lora_b_mask(trainer)
    for d in range(draws):
        vec = start.copy()
        noise = sigma * np.random.default_rng((seed, d)).standard_normal(int(is_b.sum()))
        vec[is_b] = vec[is_b] + noise if around else noise
        yield vec


def noise_margin_of(nulls: Sequence[Drift], rank: int = NULL_RANK) -> float:
    """The noise margin the null adapters' figures give: the `rank`-th widest of
    their widest lead drops (the widest when there are fewer draws; 0.0 with none)."""
    widest = sorted((n.widest_drop for n in nulls), reverse=True)
    return widest[min(rank, len(widest)) - 1] if widest else 0.0


def lora_b_mask(trainer) -> np.ndarray:
    """Which entries of `trainer.lora_parameters()` belong to a B matrix (the rest: A)."""
    return np.concatenate([np.full(int(np.prod(shape)), ab == "b") for (_, ab), shape in
                           zip(trainer.parameter_order(), trainer.parameter_shapes(), strict=True)])
