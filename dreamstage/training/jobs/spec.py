"""The job spec: every value of a training job resolved once, in one unit, and every default.

`JobSpec` is frozen and produced only by `TrainRequest.to_job_spec()`
(request.py, the one validator of a job); the rest of the code trusts it.
Stored forms are stored.py.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from dreamstage.training.jobs.example_forms import PlainExample

DEFAULT_CONTEXT_CACHE_TYPE = "q8_0"   # the training K/V cache type
LORA_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
DEFAULT_TARGETS = ("attn_q", "attn_v")
DEFAULT_RANK = 8
DEFAULT_ALPHA = 16.0

DEFAULT_WINDOW = 512
DEFAULT_CHUNK = 128            # clipped to the window
DEFAULT_MIN_CHUNK = 16         # the memory ladder's floor, clipped to the chunk
DEFAULT_MAX_SLOWDOWN = 0.10
DEFAULT_MAX_PAUSE_MS = 250.0   # the longest one micro-step may hold a chat turn up
# The memory gate keeps this much free on every device beyond the job's allowance
# (the Trainer's slack_mib); a budget at or below it leaves nothing.
GATE_SLACK_MIB = 64.0
DEFAULT_LR = 1e-3
DEFAULT_EPOCHS = 10            # an upper bound: stop_loss usually ends a small job sooner
DEFAULT_ANCHOR_RATIO = 8.0     # rehearsal windows per job window, each epoch (at most every anchor)
# What a rehearsal window trains (drift.AnchorBase.windows): "soft", the base's greedy
# answer against its recorded distributions; "samples", cross-entropy on the base's
# sampled continuations; "soft-samples", the samples against the distributions they came from
Rehearsal = Literal["soft", "samples", "soft-samples"]
REHEARSAL_MODES: tuple[Rehearsal, ...] = ("soft", "samples", "soft-samples")
DEFAULT_REHEARSAL: Rehearsal = "soft"
DEFAULT_CONSOLIDATE = 1        # rehearsal-only epochs after the job's own training ended
MAX_CONSOLIDATE = 64
# the rehearsal-only epochs' step falls linearly to 0 over their updates
# (lr x (1 - (k + 1/2) / their number))
DEFAULT_CONSOLIDATE_DECAY = True
DEFAULT_NEIGHBOURS = 4         # the base's own neighbours of each job prompt rehearsed each epoch
MAX_NEIGHBOURS = 8
DEFAULT_MAX_DRIFT = 1.0        # auto promotion: at most this fraction of anchor answers changed (1: not bounded)
DEFAULT_MAX_DRIFT_KL = 1.0     # auto promotion: at most this mean KL (nats) from the base on the held-out anchors
# end training after an epoch in which each of the job's own windows' loss is below
# this and, with the drift guard on, every checked example's greedy reply is its trained tokens
DEFAULT_STOP_LOSS = 0.2
MAX_EXTRA_ANCHORS = 64
MAX_ANCHOR_CHARS = 1000
MIN_WINDOW = 16
MAX_WINDOW = 65536
MAX_EXAMPLES = 100_000


@dataclass(frozen=True)
class PacingSpec:
    """`mode` is "share" (fraction of active wall time spent dreaming) or
    "max_slowdown" (bound on the measured decode slowdown)."""

    mode: Literal["share", "max_slowdown"]
    value: float
    max_pause_ms: float | None = DEFAULT_MAX_PAUSE_MS   # one micro-step stays inside this; None: no bound


@dataclass(frozen=True)
class SourcedExample:
    """A plain example and where it came from in the body, for error messages
    and so a group's completions are held out together (and trained as one group)."""

    source: int             # index into the body's examples (text first if given)
    label: str              # e.g. "examples[3].completions[1]" or "text"
    example: PlainExample
    group: str | None = None   # a group's completion: the group's label ("examples[3]")
    weight: float = 1.0        # a group's completion: its weight


# The stored form of a JobSpec (JobSpec.to_stored); bump on any change to it.
# 2: the drift guard's fields (regularizer, anchor_ratio, anchors, max_drift,
#    stop_loss) and group_prefix. A form-1 spec was accepted without them and
#    reads back as it meant then: no rehearsal, no early stop, no grouping.
# 3: max_drift_kl. A form-2 spec had no bound on drift_kl.
# 4: rehearsal and consolidate. Forms 2 and 3 rehearsed sampled continuations


@dataclass(frozen=True)
class JobSpec:
    """Everything the engine needs, every default resolved."""

    examples: tuple[SourcedExample, ...]
    window: int
    overlap: int
    fit: Literal["middle", "left"]
    chunk: int
    min_chunk: int
    context_cache_type: str
    recompute: bool
    exact: bool
    horizon: int | None
    memory_budget_mib: float | None
    rank: int
    alpha: float
    targets: tuple[str, ...]
    top_layers: int | None
    lr: float
    epochs: int
    val_split: float
    seed: int
    pacing: PacingSpec
    promote: Literal["never", "manual", "auto"]
    out: str | None
    regularizer: bool = True
    anchor_ratio: float = DEFAULT_ANCHOR_RATIO
    rehearsal: Rehearsal = DEFAULT_REHEARSAL
    consolidate: int = DEFAULT_CONSOLIDATE
    consolidate_decay: bool = DEFAULT_CONSOLIDATE_DECAY
    neighbours: int = DEFAULT_NEIGHBOURS
    anchors: tuple[str, ...] = ()
    max_drift: float = DEFAULT_MAX_DRIFT
    max_drift_kl: float | None = DEFAULT_MAX_DRIFT_KL   # None: drift_kl not bounded
    stop_loss: float | None = DEFAULT_STOP_LOSS
    group_prefix: bool = False   # plain examples with one rendered prompt train as one group

    def lora_fields(self) -> dict[str, Any]:
        """The LoRA shape in the native trainer's terms (LoraConfig's fields:
        targets as a comma list, top_layers 0 = every layer)."""
        return {"rank": self.rank, "alpha": self.alpha, "targets": ",".join(self.targets),
                "top_layers": self.top_layers or 0, "seed": self.seed}

    def summary(self) -> dict[str, Any]:
        """The spec without its examples (for reports)."""
        d = asdict(self)
        d.pop("examples")
        d["examples"] = len(self.examples)
        return d


def default_overlap(window: int) -> int:
    """Text windows overlap by an eighth of the window (at least one token, so
    every token after the first has a predecessor in its window)."""
    return max(1, window // 8)
