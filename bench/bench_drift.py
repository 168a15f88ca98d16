"""Recall of taught made-up facts against drift on held-out anchors, over a small grid.

    nice python bench/bench_drift.py [--out bench/results/drift-heldout.json] [--only NAME ...]
    nice -n 10 python bench/bench_drift.py --out bench/results/drift-sampled.json --only defaults sampled4 sampled8
    nice -n 10 python bench/bench_drift.py --out bench/results/drift-sampled-seed1.json --seed 1 \
        --only defaults sampled4 sampled4-ratio2
    nice python bench/bench_drift.py --seed 3 --only sampled4-ratio2 --each-epoch --noise-margin \
        --out bench/results/drift-determined-seed3-2026-12-02.json
    nice -n 5 python bench/bench_drift.py --seed 3 --only soft-ratio2-consolidate4 --each-epoch --noise-margin \
        --out bench/results/drift-soft-defaults-seed3-2026-12-02.json
    nice python bench/bench_drift.py --facts tests --only ratio8-c2 --noise-margin \
        --out bench/results/drift-tests-facts-seed0-2026-12-02.json
    nice python bench/bench_drift.py --seed 4 --only ratio8-c2 --noise-margin --scales 1 0.9 0.8 0.7 0.6 0.5 0.4 \
        --out bench/results/drift-scaled-seed4-2026-12-02.json
    nice python bench/bench_drift.py --seed 3 --only ratio8-c2 --noise-margin --jitters 9 \
        --out bench/results/drift-jitter-seed3-2026-12-03.json      # bench/drift_jitter.py reads it
    nice python bench/bench_drift.py --seed 3 --only ratio8-c6 --noise-margin --each-epoch \
        --out bench/results/drift-rest-c6-seed3-2026-12-04.json   # --rehearsal-top-k K: wider soft-target rows
    nice python bench/bench_drift.py --seed 3 --only ratio8-c2 ratio8-c2-order4 ratio8-c2-order5 --noise-margin \
        --save-params /tmp/params --out ...; then --only ratio8-c2-order-mean --save-params /tmp/params (their mean)

One resident default model (SmolLM2-135M Q4_1), one thread (two shared
cores). The base answers of the shipped anchors (both halves) and of
UNSEEN_PROMPTS are recorded once; each setting then trains the EVALUATION
facts (bench/drift_facts.py, not the tests' facts; `--facts tests` teaches the
tests' instead) as a job would: the
job's windows plus the regularizer's windows on the `rehearse` half,
shuffled per epoch, one AdamW update per window, early stop when every fact
window's loss in the epoch falls below `stop_loss` (a job's rule, through the
job's own OwnLoss; `--stop-rule mean`: their mean, as the older results
files did). A setting's `samples` (S) says what a
rehearsal window trains: the base's greedy answer (0), or, at each visit of
the anchor, the next of its first S continuations sampled from the base at
temperature 1 (rehearsal.REHEARSAL_SAMPLES; the same seeded samples for every S,
so S 4 trains the first four of S 8's). Then, with the adapter on: recall (the
key word in the greedy answer, temperature 0) and the drift figures on the
held-out `measure` half (what a job reports), on the rehearsed half and on
the unseen prompts; `changed_determined` counts the held-out anchors changed
at a base lead of at least 0.35, 0.5, 0.8 and 1.0 nats (bench_drift_floor.py's
null adapters flipped leads up to 0.35, the tests' draws up to 0.78),
`--noise-margin` measures the job's noise margin before training as its
guard does (so `anchors_changed` is the job's figure, `anchors_changed_raw`
every change), and `--each-epoch` records the held-out figures after every
epoch, and `--scales` the final adapter with its B scaled down (recall, drift,
each fact window's loss at each scale), and `--jitters K` the final adapter K
more times with the null draws' noise added to its B (`jitter`: every
position's lead drop under each of them and under the null draws, which
bench/drift_jitter.py reads). Results go to JSON; docs/benchmarks.md
quotes the table.
A setting's `rehearsal` is the job field (soft targets by default;
"samples" otherwise here), `consolidate` the rehearsal-only
epochs after the facts' stop (in DriftGuard.consolidation_order's order);
`adam_eps`, `rehearse_unseen` (the unseen prompts rehearsed too) and
`consolidate_facts` (the facts in those epochs too) and `rehearse_forms`
(drift_facts.FORM_PROMPTS rehearsed too), `no_eot` (the facts' end-of-turn
tokens out of their loss), `order_seed` (the windows' order from another seed)
and `load_mean` (no training: the mean of adapters --save-params kept) are the
benchmark's own.
(bench/results/drift-grid.json is the first session's run, before the
split: its "anchors" were all 40, rehearsed and measured alike.)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))   # drift_steps

from drift_facts import EVAL_FACTS, EXTRA_REHEARSAL_PROMPTS, FORM_PROMPTS, UNSEEN_PROMPTS, chat_examples
from drift_steps import forced_logits, greedy_answer, run_steps

from dreamstage.serving.resident import ResidentConfig, ResidentModel
from dreamstage.training.drift import decoding, records
from dreamstage.training.drift.anchors import load_anchors, rehearsal_anchors
from dreamstage.training.drift.decoding import TOP_K, log_softmax, set_context_adapter
from dreamstage.training.drift.measure import NULL_SIGMA, DriftProbe, lora_b_mask, noise_margin_of
from dreamstage.training.drift.records import AnchorBase, prompt_tokens
from dreamstage.training.drift.rehearsal import anchor_visits, consolidation_visits, rehearsal_windows, visit_choice
from dreamstage.training.drift.stopping import OwnLoss
from dreamstage.training.jobs.request import parse_train_request
from dreamstage.training.walk.examples import epoch_order, render_job
from dreamstage.training.walk.trainer import native_trainer

ALL_ATTN = "attn_q,attn_k,attn_v,attn_output"
# name: (lr, epochs, rank, targets, anchor_ratio, stop_loss[, more job fields, and "samples": S])
QV = "attn_q,attn_v"
GRID: dict[str, tuple] = {
    # the grid of the first drift work (anchors rehearsed and measured alike)
    "qv-lr1e-3-off-stop0.3": (1e-3, 10, 8, QV, 0.0, 0.3),
    "qv-lr1e-3-r2-stop0.3": (1e-3, 10, 8, QV, 2.0, 0.3),
    "qv-lr5e-4-off-stop0.3": (5e-4, 16, 8, QV, 0.0, 0.3),
    "v-lr1e-3-off-stop0.3": (1e-3, 10, 8, "attn_v", 0.0, 0.3),
    "qv-lr1e-3-r8-stop0.3": (1e-3, 10, 8, QV, 8.0, 0.3),
    "issue-12-report": (2e-3, 12, 16, ALL_ATTN, 0.0, None),
    # held-out measurement (the rehearse/measure split)
    "defaults": (1e-3, 10, 8, QV, 8.0, 0.1),
    "defaults-off": (1e-3, 10, 8, QV, 0.0, 0.1),
    "qv-top8-r8": (1e-3, 10, 8, QV, 8.0, 0.1, {"top_layers": 8}),
    "ffn_down-r8": (1e-3, 10, 8, "ffn_down", 8.0, 0.1),
    "qv-lr3e-3-r8-stop0.3": (3e-3, 10, 8, QV, 8.0, 0.3),
    "defaults-ratio2": (1e-3, 10, 8, QV, 2.0, 0.1),
    "defaults-ratio4": (1e-3, 10, 8, QV, 4.0, 0.1),
    # sampled rehearsal: "defaults" above rehearses greedy answers (samples 0)
    "sampled4": (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4}),
    "sampled8": (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 8}),
    "sampled4-ratio2": (1e-3, 10, 8, QV, 2.0, 0.1, {"samples": 4}),
    # sampled4-ratio2 with a smaller step or a smaller adapter
    "sampled4-ratio2-lr3e-4": (3e-4, 30, 8, QV, 2.0, 0.1, {"samples": 4}),
    "sampled4-ratio2-rank2": (1e-3, 10, 2, QV, 2.0, 0.1, {"samples": 4}),
    # soft targets: "rehearsal" says what a rehearsal window trains (drift.REHEARSAL_MODES)
    "soft-ratio2": (1e-3, 10, 8, QV, 2.0, 0.1, {"samples": 4, "rehearsal": "soft"}),
    "soft-ratio8": (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft"}),
    "softsamples4-ratio2": (1e-3, 10, 8, QV, 2.0, 0.1, {"samples": 4, "rehearsal": "soft-samples"}),
    "softsamples4-ratio8": (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft-samples"}),
    # AdamW's eps: its first steps move every parameter by about lr x sign(g), however small g is
    "soft-ratio8-eps1e-5": (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "adam_eps": 1e-5}),
    "soft-ratio8-eps1e-4": (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "adam_eps": 1e-4}),
    "soft-ratio8-eps1e-3": (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "adam_eps": 1e-3}),
    "soft-ratio8-lr5e-4": (5e-4, 20, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft"}),
    "soft-ratio8-unseen": (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "rehearse_unseen": True}),
    "soft-ratio2-consolidate4": (1e-3, 10, 8, QV, 2.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 4}),
    "soft-ratio2-consolidate10": (1e-3, 10, 8, QV, 2.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 10}),
    "soft-ratio8-consolidate8": (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 8}),
    "soft-ratio2-consolidate4-unseen": (1e-3, 10, 8, QV, 2.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 4,
                                                                     "rehearse_unseen": True}),
    "soft-ratio2-consolidate4-unseen-facts": (1e-3, 10, 8, QV, 2.0, 0.1, {
        "samples": 4, "rehearsal": "soft", "consolidate": 4, "rehearse_unseen": True, "consolidate_facts": True}),
}
# A kept out of the rehearsal windows' input span, and the rehearsal-only epochs' step decayed ...
for _e in (0.9, 0.99):     # A kept out of the rehearsal windows' input span (drift_project.py)
    GRID[f"defaults-project{_e}"] = (1e-3, 10, 8, QV, 2.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 4,
                                                                 "project": _e})
GRID["defaults-decay"] = (1e-3, 10, 8, QV, 2.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 4,
                                                        "consolidate_decay": True})
# ... and the rehearsal step taken 3x (emulated), on the 80 prompts of the set now shipped
GRID["ratio2-step3-c0"] = (1e-3, 10, 8, QV, 2.0, 0.1, {"samples": 4, "rehearsal": "soft", "rehearsal_step": 3.0})
# ratio 2 with 4 rehearsal-only epochs, ratio 8 with none, with 2, with 2 and the facts in them;
# and 60 extra prompts
GRID["ratio2-c4"] = (1e-3, 10, 8, QV, 2.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 4})
GRID["ratio8-c0"] = (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft"})
GRID["ratio8-c2"] = (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 2})
GRID["ratio8-c2-facts"] = (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 2,
                                                         "consolidate_facts": True})
GRID["ratio8-c2-extra60"] = (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 2,
                                                           "rehearse_extra": 60})
# ratio 8 with more rehearsal-only epochs, recall and drift after each; and the adapter on the top half
# of the blocks only
GRID["ratio8-c6"] = (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 6})
GRID["ratio8-c2-top15"] = (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 2,
                                                         "top_layers": 15})
# a smaller step for the rehearsal windows (emulated), or for every window
GRID["ratio8-c2-rstep0.5"] = (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 2,
                                                            "rehearsal_step": 0.5})
GRID["ratio8-c2-lr5e-4"] = (5e-4, 20, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 2})
# each fact window's loss after each of 4 rehearsal-only epochs (with --each-epoch)
GRID["ratio8-c4"] = (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 4})
# ratio8-c2 with questions of the taught forms rehearsed too (drift_facts.FORM_PROMPTS)
GRID["ratio8-c2-near2"] = (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 2,
                                                         "neighbours": 2})
GRID["ratio8-c2-near2j"] = (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 2,
                                                          "neighbours": 2, "neighbours_consolidate": False})
# ratio8-c2 with the adapter on the MLP instead of attention's q and v
GRID["ratio8-c2-down"] = (1e-3, 10, 8, "ffn_down", 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 2})
GRID["ratio8-c2-updown"] = (1e-3, 10, 8, "ffn_up,ffn_down", 8.0, 0.1, {"samples": 4, "rehearsal": "soft",
                                                                        "consolidate": 2})
# ... and ratio8-c2 stopping a step earlier (the facts' loss under 0.2, not 0.1)
GRID["ratio8-c2-stop0.2"] = (1e-3, 10, 8, QV, 8.0, 0.2, {"samples": 4, "rehearsal": "soft", "consolidate": 2})
# ... and every rehearsal anchor in every epoch of the facts (ratio 16: 96 wanted, all 80)
GRID["ratio16-c2"] = (1e-3, 10, 8, QV, 16.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 2})
GRID["ratio8-c2-forms"] = (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 2,
                                                         "rehearse_forms": True})
# SGD with momentum instead of AdamW's per-parameter normalized step (emulated: AdamW
# with eps 1, far above every sqrt(v), takes lr x the bias-corrected first moment), at two lr
GRID["ratio8-c2-sgd0.5"] = (0.5, 15, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 2,
                                                          "adam_eps": 1.0})
GRID["ratio8-c2-sgd1"] = (1.0, 15, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 2,
                                                        "adam_eps": 1.0})
# ... and AdamW on the mean gradient of 9 windows (one update where there were 9: a fact's window and
# 8 rehearsal windows on average, the regularized objective's gradient), and rank 2
GRID["ratio8-c2-acc9"] = (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 2,
                                                        "accumulate": 9})
GRID["ratio8-c2-r2"] = (1e-3, 10, 2, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 2})
# ... and the mean of the rehearsal-only epochs' iterates as the final adapter
GRID["ratio8-c2-avg"] = (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 2,
                                                       "consolidate_average": True})
# decoupled weight decay on the B matrices only (emulated: after each update B -= lr x wd x B), in the
# facts' epochs and, with "wd_consolidate", in the rehearsal-only epochs too; and a linear lr warm-up over the
# first `warmup` updates (emulated: each such update taken at a fraction of AdamW's step)
for _wd in (2, 5, 10, 20, 50):
    GRID[f"ratio8-c2-wdb{_wd}"] = (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 2,
                                                                "weight_decay_b": float(_wd)})
    GRID[f"ratio8-c2-wdb{_wd}c"] = (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 2,
                                                                 "weight_decay_b": float(_wd), "wd_consolidate": True})
for _wd in (10, 30):   # ... in the rehearsal-only epochs alone, the facts trained in them too (they hold what B needs)
    GRID[f"ratio8-c2-facts-wdb{_wd}only"] = (1e-3, 10, 8, QV, 8.0, 0.1, {
        "samples": 4, "rehearsal": "soft", "consolidate": 2, "consolidate_facts": True, "weight_decay_b": float(_wd),
        "wd_consolidate": "only"})
# ... and six rehearsal-only epochs with the facts' windows in them
GRID["ratio8-c6-facts"] = (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 6,
                                                        "consolidate_facts": True})
for _w in (50, 200):
    GRID[f"ratio8-c2-warm{_w}"] = (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 2,
                                                                "warmup": _w})
# the regularizer alone, from B = 0 (no fact window trained; six epochs of the facts' rehearsal
# windows and the two rehearsal-only epochs)
GRID["ratio8-c2-nofacts"] = (1e-3, 6, 8, QV, 8.0, None, {"samples": 4, "rehearsal": "soft", "consolidate": 2,
                                                          "no_facts": True})
# ... the regularizer alone at a tenth of the step (each rehearsal update at 0.1 of AdamW's, emulated: lr 1e-4)
GRID["ratio8-nofacts-rstep0.1"] = (1e-3, 6, 8, QV, 8.0, None, {"samples": 4, "rehearsal": "soft", "no_facts": True,
                                                                "rehearsal_step": 0.1})
# ... and, since the regularizer's own jitter scales with the step, the rehearsal-only epochs' step falling linearly
# to 0 over their updates (consolidate_decay) with the rest counted
for _c in (2, 4):
    GRID[f"ratio8-c{_c}-decay"] = (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": _c,
                                                               "consolidate_decay": True})
# ... and AdamW's eps raised (a step proportional to g where |g| is below it: no lr-sized steps along coordinates
# whose gradient is only the regularizer's noise), with the rest counted
for _e in ("1e-5", "1e-4"):
    GRID[f"ratio8-c2-eps{_e}"] = (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 2,
                                                              "adam_eps": float(_e)})
# ... and six rehearsal-only epochs that repair the facts: after every 8 rehearsal windows each fact window above a
# forward loss of 0.15 is trained once
GRID["ratio8-c6-repair0.15"] = (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 6,
                                                              "repair": (0.15, 8)})
# the facts' end-of-turn token out of their loss
GRID["ratio8-c2-noeot"] = (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 2,
                                                        "no_eot": True})
# ... and ratio8-c2's adapter averaged over three runs that differ only in the windows' order (the same
# initial A, job seed 3): --save-params DIR keeps each run's parameters, the mean setting reads them there
for _o in (4, 5):
    GRID[f"ratio8-c2-order{_o}"] = (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 2,
                                                                 "order_seed": _o})
GRID["ratio8-c2-order-mean"] = (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 2,
                                                            "load_mean": ["ratio8-c2-seed3.npy",
                                                                          "ratio8-c2-order4-seed3.npy",
                                                                          "ratio8-c2-order5-seed3.npy"]})
# ... and the two that each held one of the changes left: the facts' neighbours rehearsed in their epochs
# (near2j) with four rehearsal-only epochs whose step falls to 0 (c4-decay)
GRID["ratio8-c4-decay-near2j"] = (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 4,
                                                               "consolidate_decay": True, "neighbours": 2,
                                                               "neighbours_consolidate": False})
# the same with four neighbours a prompt (the currency of Japan moved on both seeds with two)
GRID["ratio8-c4-decay-near4j"] = (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 4,
                                                               "consolidate_decay": True, "neighbours": 4,
                                                               "neighbours_consolidate": False})
# ... and ratio8-c2 with four neighbours a prompt (no other change: `neighbours` is a job field already)
GRID["ratio8-c2-near4j"] = (1e-3, 10, 8, QV, 8.0, 0.1, {"samples": 4, "rehearsal": "soft", "consolidate": 2,
                                                          "neighbours": 4, "neighbours_consolidate": False})
# feedback jobs (records/learner.FEEDBACK_JOB): stop_loss 0.05 and up to 20 epochs; as they are, and faster
# (a larger step, fewer rehearsal windows an epoch, fewer rehearsal-only epochs)
_FB = {"samples": 4, "rehearsal": "soft", "consolidate_decay": True, "neighbours": 4, "neighbours_consolidate": False}
GRID["fb-now"] = (1e-3, 20, 8, QV, 8.0, 0.05, {**_FB, "consolidate": 4})
GRID["fb-lr2e-3-c2"] = (2e-3, 20, 8, QV, 8.0, 0.05, {**_FB, "consolidate": 2})
GRID["fb-lr3e-3-r4-c2"] = (3e-3, 20, 8, QV, 4.0, 0.05, {**_FB, "consolidate": 2})
GRID["fb-lr3e-3-r4-c1"] = (3e-3, 20, 8, QV, 4.0, 0.05, {**_FB, "consolidate": 1})
GRID["fb-s0.2-c2"] = (1e-3, 20, 8, QV, 8.0, 0.2, {**_FB, "consolidate": 2})
GRID["fb-s0.2-r4-c2"] = (1e-3, 20, 8, QV, 4.0, 0.2, {**_FB, "consolidate": 2})
_ACTS: dict = {}   # per process: the projection's attn inputs and the extra prompts' records, by setting
MAX_SAMPLES = max(c[6].get("samples", 0) for c in GRID.values() if len(c) > 6)
FACTS = EVAL_FACTS        # what a setting teaches: the evaluation facts, or with --facts tests the tests'
# the early stop: "each" (a job's rule, OwnLoss: every fact window's training loss of the epoch below stop_loss)
# or "mean" (their token-weighted mean; the older results files used it)
STOP_RULE = "each"


def tests_facts() -> list[tuple[str, str, str]]:
    """tests/test_drift.py's TEST_FACTS, read from its source (not imported: the module needs pytest)."""
    import ast
    tree = ast.parse((Path(__file__).resolve().parent.parent / "tests" / "test_drift.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "TEST_FACTS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError("tests/test_drift.py has no TEST_FACTS")


def changed_within(drift, n_tokens: int) -> float:
    """The fraction of anchors whose answer changed within its first n_tokens."""
    return sum(f is not None and f < n_tokens for f in drift.first_change) / max(len(drift.first_change), 1)


def anchor_windows(bases: Sequence[AnchorBase], visits: Iterable[tuple[int, int]], window: int,
                   mode: str | None = None) -> list:
    """The regularizer's windows for (anchor, visit) pairs (anchor_visits),
    each the visit's choice (visit_choice) of the anchor's windows (its greedy
    answer when it has no samples); an anchor with no window that fits is left out."""
    out = []
    for i, v in visits:
        fitting = rehearsal_windows(bases[i], i, window, mode)
        if fitting:
            out.append(visit_choice(fitting, v))
    return out


def recall(rm, handle, facts) -> tuple[float, list[str]]:
    set_context_adapter(rm, handle)
    try:
        answers = [rm.detokenize([t for t in greedy_answer(rm, 0, prompt_tokens(rm, q), 24) if not rm.is_eog(t)])
                   for q, _, _ in facts]
    finally:
        set_context_adapter(rm, None)
    hits = [key.lower() in a.lower() for a, (_, _, key) in zip(answers, facts, strict=True)]
    return sum(hits) / len(hits), answers


def changed_where_sure(drift, bases, p: float = 0.5) -> float:
    """The fraction of anchors whose greedy answer changed at a token where the
    base's own top choice had probability >= p: changes that are not the base's
    near ties (docs/architecture/drift.md, "The noise margin")."""
    sure = [f is not None and float(b.top_logp[f].max()) >= math.log(p) for f, b in zip(drift.first_change, bases,
                                                                                          strict=True)]
    return sum(sure) / max(len(sure), 1)


def answer_logprobs(rm, probe, handle) -> list[np.ndarray]:
    """Per anchor, the log-probabilities at each position of the base's answer,
    teacher-forced on it in the measurement's pieces, with `handle` on the
    context (None: the base)."""
    out = []
    set_context_adapter(rm, handle)
    try:
        for b in probe.bases:
            rows = forced_logits(rm, 0, b.forced, len(b.prompt_tokens) - 1)
            out.append(log_softmax(rows[:len(b.answer)].astype(np.float64)))
    finally:
        set_context_adapter(rm, None)
    return out


# Base margins (log p1 - log p2) above which changes are counted in `changed_determined`:
# bench_drift_floor.py's null adapters (nothing learned) flipped base choices at margins up
# to 0.29 (sigma 1e-4) and 0.35 (1e-2) on the default model (drift-floor-2026-12-02.json)
DETERMINED_MARGINS = (0.35, 0.5, 0.8, 1.0)
JITTER_SEED = 41      # the adapter jitters (--jitters), apart from the null draws (NULL_SEED)


def changed_determined(probe, lqs, margins=DETERMINED_MARGINS) -> dict:
    """Per margin m: how many anchors the adapter's argmax leaves the base's answer at a
    position where the base's top token led its second by at least m nats (a change no
    null adapter made), and how many before the base's first position with a smaller lead
    (the answer's prefix up to its first near tie)."""
    out: dict = {}
    for m in margins:
        anywhere = before_tie = 0
        for b, lq in zip(probe.bases, lqs, strict=True):
            lp = np.sort(b.top_logp.astype(np.float64), axis=1)
            lead = lp[:, -1] - lp[:, -2]
            flips = np.flatnonzero(lq.argmax(axis=1) != np.asarray(b.answer))
            tie = int(np.argmax(lead < m)) if (lead < m).any() else len(lead)
            anywhere += bool((lead[flips] >= m).any())
            before_tie += bool((flips < tie).any())
        out[str(m)] = {"anywhere": anywhere, "before_first_tie": before_tie}
    return out


def first_changes(rm, probe, handle, lqs=None) -> list[dict]:
    """Per held-out anchor, where the adapter's greedy answer first leaves the
    base's: the position, the base's token and its top two probabilities there,
    and the adapter's choice with the probabilities it gives both."""
    out = []
    for b, lq in zip(probe.bases, lqs if lqs is not None else answer_logprobs(rm, probe, handle), strict=True):
        choice = lq.argmax(axis=1)
        diff = np.flatnonzero(choice != np.asarray(b.answer))
        rec: dict = {"prompt": b.prompt, "base_answer": rm.detokenize(list(b.answer))}
        if diff.size:
            f = int(diff[0])
            p = np.sort(np.exp(b.top_logp[f].astype(np.float64)))[::-1]
            new = int(choice[f])
            rec.update(position=f, prefix=rm.detokenize(list(b.answer[:f])),
                       base_token=rm.detokenize([int(b.answer[f])]), base_p_top2=[float(p[0]), float(p[1])],
                       adapter_token="<end of turn>" if rm.is_eog(new) else rm.detokenize([new]),
                       adapter_p_own=float(np.exp(lq[f, new])), adapter_p_base=float(np.exp(lq[f, b.answer[f]])))
        out.append(rec)
    return out


def window_losses(evaluator, params, windows) -> list[float]:
    """Each window's forward loss with `params` in the lr-0 `evaluator` (rounded for the JSON)."""
    evaluator.set_lora_parameters(params)
    return [round(evaluator.window_loss(evaluator.train_window(w.tokens, w.mask)), 4) for w in windows]


def at_scales(rm, probe, unseen, spec, trainer, facts, scales) -> list[dict]:
    """The final adapter with every B scaled by s (the adapter a job would save
    scaled down): recall, the held-out figures, the unseen prompts' drift_kl and
    each fact window's forward loss, for each s. The trainer is put back as it was."""
    before = trainer.lora_parameters()
    is_b = lora_b_mask(trainer)
    evaluator = native_trainer(rm, spec, spec.chunk, 0.0)              # lr 0: forward losses
    rows = []
    try:
        for s in scales:
            vec = before.copy()
            vec[is_b] *= s
            trainer.set_lora_parameters(vec)
            trainer.promote()
            losses = window_losses(evaluator, vec, facts)
            rec, answers = recall(rm, trainer.served_adapter, FACTS)
            d = run_steps(probe.measure(trainer.served_adapter))
            du = run_steps(unseen.measure(trainer.served_adapter))
            row = {"scale": s, "recall": rec, "drift_kl": d.drift_kl, "changed_beyond_margin": d.changed,
                   "changed": d.changed_raw, "noise_margin": d.noise_margin,
                   "widest_flip_lead": max((x for lead in d.flip_leads for x in lead), default=0.0),
                   "unseen_drift_kl": du.drift_kl, "fact_window_losses": losses, "answers": answers}
            print(json.dumps({k: v for k, v in row.items() if k != "answers"}), flush=True)
            rows.append(row)
    finally:
        evaluator.close()
        trainer.set_lora_parameters(before)
        trainer.promote()
    return rows


def at_jitters(probe, trainer, k: int, seed: int = JITTER_SEED) -> list:
    """The final adapter measured k more times, each with NULL_SIGMA noise added to
    every B (DriftProbe.null_drifts around it, draw d seeded by (seed, d)). The
    trainer is put back."""
    return run_steps(probe.null_drifts(trainer, k, NULL_SIGMA, seed, around=True))


def recorded(rm, key, prompts) -> list:
    """The base records of `prompts` (rehearsed beside the shipped set), made once per process under `key`."""
    if key not in _ACTS:
        extra = DriftProbe(rm, prompts, seq_id=0)
        run_steps(extra.record())
        _ACTS[key] = list(extra.bases)
    return _ACTS[key]


def unmask_end(rm, tokens, mask) -> tuple[int, ...]:
    """`mask` without its end-of-turn loss tokens."""
    return tuple(0 if rm.is_eog(int(t)) else m for t, m in zip(tokens, mask, strict=True))


@dataclass
class Knobs:
    """A setting's benchmark-only options, popped from its `more` (the rest are job fields)."""
    samples: int = 0                 # the rehearsal data: the first `samples` samples, or the greedy answers (0)
    rehearsal: str = "samples"       # the job field's rehearsal mode (soft targets are "soft")
    adam_eps: float | None = None    # AdamW's eps (not a job field; the trainer's 1e-8 when None)
    accumulate: int = 1              # windows per AdamW update, their gradients averaged (not a job field)
    # rehearse the unseen prompts too (40 rehearsal anchors): does more rehearsal data hold the held-out half?
    rehearse_unseen: bool = False
    consolidate: int = 0             # rehearsal-only epochs (every anchor) after the facts' last epoch
    # the facts' windows once in each of those epochs too (not what a job does: a question for more prompts)
    consolidate_facts: bool = False
    project: float | None = None     # A kept out of the rehearsal windows' input span (drift_project.py)
    # the consolidation's step size falling linearly to 0 over its updates (emulated: each update
    # taken as a fraction of AdamW's step, since lr does not enter the moments)
    consolidate_decay: bool = False
    # the adapter at the end: the mean of its iterates over the rehearsal-only epochs' updates (the step's
    # jitter about where the rehearsal pulls averaged out), not the last one
    consolidate_average: bool = False
    rehearse_extra: int = 0          # the first this many EXTRA_REHEARSAL_PROMPTS rehearsed too
    rehearse_forms: bool = False     # FORM_PROMPTS rehearsed too (the taught forms' questions)
    rehearsal_step: float = 1.0      # a rehearsal window's update taken at this multiple (emulated)
    # the base's own neighbours of each fact's question (DriftProbe.neighbours_of), every one rehearsed each epoch
    neighbours: int = 0
    neighbours_consolidate: bool = True   # ... and in the rehearsal-only epochs too
    weight_decay_b: float = 0.0      # decoupled weight decay on B only (emulated), the facts' epochs
    wd_consolidate: bool | str = False    # ... and the rehearsal-only epochs ("only": there alone)
    warmup: int = 0                  # linear lr warm-up over this many updates (emulated)
    # the facts' windows left out of every epoch (the rehearsal windows as the facts' count would visit them):
    # the drift the regularizer makes by itself, from B = 0
    no_facts: bool = False
    # in the rehearsal-only epochs, after every `every` rehearsal windows, each fact window whose forward loss is
    # above `threshold` is trained once (a repair step): the facts as a constraint, not a pull
    repair: tuple | None = None
    # the facts' windows without their end-of-turn token in the loss: the style the one-sentence answers teach
    # (stop after one sentence) kept out of the gradient; at B = 0 the end-of-turn token's gradient alone has
    # cosine 0.16 to 0.91 with its window's
    no_eot: bool = False
    # the windows' order (epoch_order, anchor_visits, consolidation_visits) from this seed, the adapter's
    # initial A still from the job's `seed`: runs that differ in their order only
    order_seed: int | None = None
    # no training: the adapter is the mean of these saved parameter vectors (--save-params), then measured
    load_mean: list | None = None

    @classmethod
    def pop_from(cls, more: dict) -> Knobs:
        return cls(**{f.name: more.pop(f.name) for f in fields(cls) if f.name in more})

    def record(self) -> dict:
        """The knobs as the results file names them."""
        out = asdict(self)
        out["rehearsal_samples"] = out.pop("samples")
        out["repair"] = list(self.repair) if self.repair else None
        return out


def setting_bases(rm, probe, rehearsal, unseen, k: Knobs) -> tuple[list, list]:
    """The setting's rehearsal anchors, and the neighbours of the facts' questions it rehearses."""
    bases = [replace(b, samples=b.samples[:k.samples], sample_top=b.sample_top[:k.samples]) for b in rehearsal.bases]
    if k.rehearse_unseen:
        bases += list(unseen.bases)
    if k.rehearse_extra:
        bases += recorded(rm, ("extra", k.rehearse_extra), EXTRA_REHEARSAL_PROMPTS[:k.rehearse_extra])
    if k.rehearse_forms:
        bases += recorded(rm, ("forms",), FORM_PROMPTS)
    near: list = []
    if k.neighbours:
        questions = [q for q, _, _ in FACTS]
        key = ("neighbours", k.neighbours, tuple(questions))
        if key not in _ACTS:
            _ACTS[key + ("prompts",)] = run_steps(probe.neighbours_of(questions, k.neighbours, exclude=probe.prompts))
        near = recorded(rm, key, _ACTS[key + ("prompts",)])
    return bases, near


def setting_trainer(rm, spec, lr, k: Knobs, bases):
    """The job's trainer (with the knobs' optimizer when they change it) and the projection, if any."""
    trainer = native_trainer(rm, spec, spec.chunk)
    if k.adam_eps is not None or k.accumulate != 1:
        from dreamstage.training.walk.trainer import LoraConfig, OptimizerConfig, Trainer
        trainer.close()
        opt = OptimizerConfig(lr=lr, eps=1e-8 if k.adam_eps is None else k.adam_eps, accumulate_windows=k.accumulate)
        trainer = Trainer(rm, LoraConfig(**spec.lora_fields()), cache_type=spec.context_cache_type,
                          window=spec.window, chunk=spec.chunk, optimizer=opt)
    proj = None
    if k.project is not None:
        from drift_project import Projection, attn_inputs, projectors
        key = ("acts", len(bases))
        if key not in _ACTS:
            _ACTS[key] = attn_inputs(rm.model_path, [b.prompt_tokens + tuple(b.answer) for b in bases])
        projs, ks = projectors(_ACTS[key], k.project)
        print(f"projection energy {k.project}: k per layer {ks}", flush=True)
        proj = Projection(trainer, projs)
    return trainer, proj


class SettingRun:
    """One setting's training: the facts' epochs with their rehearsal windows (a job's early stop),
    then the rehearsal-only epochs; the figures after each epoch, and what the measuring took."""

    def __init__(self, rm, probe, trainer, proj, facts, bases, near, spec, k: Knobs, seed: int, lr: float,
                 ratio: float, each_epoch: bool):
        self.rm, self.probe, self.trainer, self.proj, self.k, self.lr = rm, probe, trainer, proj, k, lr
        self.ratio = ratio
        self.facts, self.bases, self.near, self.window, self.each_epoch = facts, bases, near, spec.window, each_epoch
        self.oseed = seed if k.order_seed is None else k.order_seed
        self.evaluator = native_trainer(rm, spec, spec.chunk, 0.0) if (each_epoch or k.repair) else None  # lr 0
        self.b_mask = lora_b_mask(trainer) if k.weight_decay_b else None
        self.updates = self.anchored = 0
        self.measured_s = 0.0          # seconds the per-epoch figures took (not training)
        self.epoch_losses: list[float] = []
        self.recall_per_epoch: list[float] = []
        self.drift_per_epoch: list[dict] = []
        self.fact_window_losses: list[list[float]] = []
        self.repairs: list[int] = []   # repair steps per rehearsal-only epoch

    def emulate_step(self, before: np.ndarray, frac: float, wd: float) -> None:
        """The update just taken, at `frac` of AdamW's step (lr does not enter the moments), then
        decoupled weight decay on B: B -= lr x wd x B (from before the update, as AdamW decays)."""
        theta = before + frac * (self.trainer.lora_parameters() - before)
        if wd:
            theta[self.b_mask] -= self.lr * wd * before[self.b_mask]
        self.trainer.set_lora_parameters(theta)

    def after_epoch(self, number: int) -> None:
        """Recall, and with each_epoch the held-out figures and each fact window's forward loss."""
        self.trainer.promote()
        self.recall_per_epoch.append(recall(self.rm, self.trainer.served_adapter, FACTS)[0])
        if not self.each_epoch:
            return
        t_e = time.perf_counter()
        self.fact_window_losses.append(window_losses(self.evaluator, self.trainer.lora_parameters(), self.facts))
        d_e = run_steps(self.probe.measure(self.trainer.served_adapter))
        self.drift_per_epoch.append({
            "epoch": number, "drift_kl": d_e.drift_kl, "changed": d_e.changed_raw, "changed_beyond_margin": d_e.changed,
            "changed_at_lead": {str(m): sum(any(x >= m for x in lead) for lead in d_e.flip_leads)
                                for m in DETERMINED_MARGINS}})
        self.measured_s += time.perf_counter() - t_e

    def fact_epochs(self, epochs: int, stop_loss: float | None) -> None:
        k, facts, trainer = self.k, self.facts, self.trainer
        for epoch in range(epochs):
            own = OwnLoss(len(facts), stop_loss)     # the job's own early-stop bookkeeping
            windows = facts + anchor_windows(self.bases, anchor_visits(len(self.bases), len(facts), self.ratio,
                                                                       epoch, self.oseed), self.window, k.rehearsal)
            windows += anchor_windows(self.near, [(i, epoch) for i in range(len(self.near))], self.window,
                                      k.rehearsal)
            self.anchored += len(windows) - len(facts)
            for w in epoch_order(len(windows), epoch, self.oseed):
                if k.no_facts and w < len(facts):
                    continue
                frac = k.rehearsal_step if w >= len(facts) else 1.0
                if k.warmup:
                    frac *= min(1.0, (self.updates + 1) / k.warmup)
                decays = k.weight_decay_b and k.wd_consolidate != "only"
                before_step = trainer.lora_parameters() if (frac != 1.0 or decays) else None
                rec = trainer.train_window(windows[w].tokens, windows[w].mask, windows[w].soft)
                if before_step is not None:
                    self.emulate_step(before_step, frac, 0.0 if k.wd_consolidate == "only" else k.weight_decay_b)
                if self.proj is not None:
                    self.proj.apply()
                self.updates += 1
                for r in rec:
                    own.note(w, r)
            each_below = own.converged()
            self.epoch_losses.append(own.mean if own.mean is not None else float("nan"))
            self.after_epoch(epoch + 1)
            if each_below if STOP_RULE == "each" else (stop_loss is not None and self.epoch_losses[-1] < stop_loss):
                break

    def repair_facts(self) -> int:
        """Each fact window whose forward loss is above the repair threshold, trained once; how many."""
        losses = window_losses(self.evaluator, self.trainer.lora_parameters(), self.facts)
        high = [i for i, loss in enumerate(losses) if loss > self.k.repair[0]]
        for i in high:
            self.trainer.train_window(self.facts[i].tokens, self.facts[i].mask, self.facts[i].soft)
        return len(high)

    def consolidation(self) -> None:
        """The rehearsal-only epochs, as DriftGuard.consolidation_order visits them."""
        k, facts, trainer = self.k, self.facts, self.trainer
        plan = []
        for c in range(k.consolidate):
            pool = self.bases + self.near if k.neighbours_consolidate else self.bases
            windows = anchor_windows(pool, consolidation_visits(len(pool), c, self.oseed), self.window, k.rehearsal)
            if k.consolidate_facts:
                windows = [(facts + windows)[i] for i in epoch_order(len(facts) + len(windows), 1000 + c, self.oseed)]
            plan.append(windows)
        n_cons, done_cons = sum(len(x) for x in plan), 0
        iterate_sum = None
        cons_wd = k.weight_decay_b if k.wd_consolidate else 0.0
        for c, windows in enumerate(plan):
            self.anchored += len(windows)
            self.repairs.append(0)
            for i, w in enumerate(windows):
                before_step = trainer.lora_parameters() if (k.consolidate_decay or cons_wd) else None
                trainer.train_window(w.tokens, w.mask, w.soft)
                if before_step is not None:
                    self.emulate_step(before_step, 1.0 - (done_cons + 0.5) / n_cons if k.consolidate_decay else 1.0,
                                      cons_wd)
                done_cons += 1
                if self.proj is not None:
                    self.proj.apply()
                if k.repair and ((i + 1) % k.repair[1] == 0 or i + 1 == len(windows)):
                    n = self.repair_facts()
                    self.repairs[-1] += n
                    self.updates += n
                if k.consolidate_average:
                    theta = trainer.lora_parameters().astype(np.float64)
                    iterate_sum = theta if iterate_sum is None else iterate_sum + theta
                self.updates += 1
            self.after_epoch(len(self.epoch_losses) + c + 1)
        if iterate_sum is not None:
            trainer.set_lora_parameters((iterate_sum / done_cons).astype(np.float32))
            trainer.promote()
            self.recall_per_epoch.append(recall(self.rm, trainer.served_adapter, FACTS)[0])

    def close(self) -> None:
        self.trainer.close()
        if self.evaluator is not None:
            self.evaluator.close()


def final_figures(rm, probe, rehearsal, unseen, run: SettingRun, spec, name: str, seed: int, on_adapter,
                  scales, jitters, save_params) -> dict:
    """The trained adapter's figures: recall, drift on the held-out, rehearsed and unseen anchors,
    where answers first change, and the optional scaled and jittered adapters."""
    trainer = run.trainer
    trainer.promote()
    if save_params:
        Path(save_params).mkdir(parents=True, exist_ok=True)
        np.save(Path(save_params) / f"{name}-seed{seed}.npy", trainer.lora_parameters().astype(np.float32))
    t1 = time.perf_counter()
    drift = run_steps(probe.measure(trainer.served_adapter))
    measure_s = time.perf_counter() - t1
    drift_rehearsed = run_steps(rehearsal.measure(trainer.served_adapter))
    drift_unseen = run_steps(unseen.measure(trainer.served_adapter))
    rec_frac, answers = recall(rm, trainer.served_adapter, FACTS)
    lqs = answer_logprobs(rm, probe, trainer.served_adapter)
    changes = first_changes(rm, probe, trainer.served_adapter, lqs)
    determined = changed_determined(probe, lqs)
    if on_adapter is not None:           # a caller's own look at the final adapter (bench_drift_floor)
        on_adapter(trainer.served_adapter)
    return {"drift": drift, "recall": rec_frac, **drift.as_dict(),
            "anchors_changed_12": changed_within(drift, 12), "anchors_changed_6": changed_within(drift, 6),
            "anchors_changed_sure": changed_where_sure(drift, probe.bases), "changed_determined": determined,
            "rehearsed_drift_kl": drift_rehearsed.drift_kl, "rehearsed_changed": drift_rehearsed.anchors_changed,
            "unseen_drift_kl": drift_unseen.drift_kl, "unseen_changed": drift_unseen.anchors_changed,
            "unseen_changed_12": changed_within(drift_unseen, 12),
            "measure_s": measure_s, "answers": answers, "first_changes": changes,
            "flip_leads": drift.flip_leads,
            "at_scales": at_scales(rm, probe, unseen, spec, trainer, run.facts, scales) if scales else [],
            "jittered": at_jitters(probe, trainer, jitters) if jitters else []}


def run_setting(rm, probe, rehearsal, unseen, name, lr, epochs, rank, targets, ratio, stop_loss, more=None,
                seed=0, on_adapter=None, each_epoch=False, noise=False, scales=(), jitters=0,
                save_params=None) -> dict:
    more = dict(more or {})
    k = Knobs.pop_from(more)
    bases, near = setting_bases(rm, probe, rehearsal, unseen, k)
    body = {"examples": chat_examples(FACTS), "lr": lr, "epochs": epochs, "rank": rank, "targets": targets,
            "seed": seed, **more}
    spec = parse_train_request(body).to_job_spec()
    facts = list(render_job(spec, rm).train)
    if k.no_eot:
        facts = [replace(w, mask=unmask_end(rm, w.tokens, w.mask)) for w in facts]
    trainer, proj = setting_trainer(rm, spec, lr, k, bases)
    # the job's noise margin, as its guard measures it before training (anchors_changed beyond it)
    probe.noise_margin = None
    margin_s = time.perf_counter()
    nulls = run_steps(probe.null_drifts(trainer)) if noise else []
    noise_margin = noise_margin_of(nulls) if noise else None
    probe.noise_margin = noise_margin
    margin_s = time.perf_counter() - margin_s
    t0 = time.perf_counter()
    run = SettingRun(rm, probe, trainer, proj, facts, bases, near, spec, k, seed, lr, ratio, each_epoch)
    if k.load_mean:
        epochs, k.consolidate = 0, 0
        if not save_params:
            raise SystemExit(f"{name}: load_mean reads its files from --save-params")
        vecs = [np.load(Path(save_params) / f) for f in k.load_mean]
        trainer.set_lora_parameters(np.mean(vecs, axis=0).astype(np.float32))
    try:
        run.fact_epochs(epochs, stop_loss)
        run.consolidation()
        train_s = time.perf_counter() - t0 - run.measured_s
        fig = final_figures(rm, probe, rehearsal, unseen, run, spec, name, seed, on_adapter, scales, jitters,
                            save_params)
    finally:
        run.close()
    drift, jittered = fig.pop("drift"), fig.pop("jittered")
    out = {"name": name, **more, **k.record(), "neighbour_prompts": [b.prompt for b in near],
           "repairs_per_epoch": run.repairs, "lr": lr, "epochs": epochs, "epochs_run": len(run.epoch_losses),
           "rank": rank, "targets": targets, "anchor_ratio": ratio, "anchor_windows_trained": run.anchored,
           "stop_loss": stop_loss, "updates": run.updates, "fact_loss_per_epoch": run.epoch_losses,
           "recall_per_epoch": run.recall_per_epoch, "fact_window_losses_per_epoch": run.fact_window_losses,
           **fig, "train_s": train_s, "drift_per_epoch": run.drift_per_epoch, "noise_margin_s": margin_s}
    if jitters:
        out["jitter"] = {"sigma": NULL_SIGMA, "base_leads": [b.leads().round(4).tolist() for b in probe.bases],
                         "adapter_drops": [[round(x, 4) for x in d] for d in drift.drops],
                         "null_drops": [[[round(x, 4) for x in d] for d in n.drops] for n in nulls],
                         "jitter_drops": [[[round(x, 4) for x in d] for d in j.drops] for j in jittered]}
    probe.noise_margin = None
    if noise_margin is not None:
        out["noise_margin"] = noise_margin
    quiet = ("answers", "first_changes", "drift_per_epoch", "flip_leads", "at_scales", "jitter")
    print(json.dumps({key: v for key, v in out.items() if key not in quiet}), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/drift-heldout.json")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--seed", type=int, default=0, help="the job's seed (window order, LoRA init, anchor rotation)")
    ap.add_argument("--each-epoch", action="store_true", help="measure the held-out anchors after every epoch too")
    ap.add_argument("--noise-margin", action="store_true",
                    help="measure the job's noise margin first, as its guard does: anchors_changed beyond it")
    ap.add_argument("--jitters", type=int, default=0,
                    help="measure the final adapter this many times more with NULL_SIGMA noise on B (jitter)")
    ap.add_argument("--scales", type=float, nargs="*", default=[],
                    help="measure the final adapter with B scaled by each of these too (at_scales)")
    ap.add_argument("--facts", choices=("eval", "tests"), default="eval",
                    help="teach the evaluation facts (bench/drift_facts.py) or the tests' (tests/test_drift.py)")
    ap.add_argument("--rehearsal-top-k", type=int, default=0,
                    help="record the rehearsal anchors' distributions with this many top tokens (default drift.TOP_K)")
    ap.add_argument("--save-params", default=None,
                    help="save each setting's final LoRA parameters here (NAME-seedS.npy; load_mean reads them)")
    ap.add_argument("--stop-rule", choices=("each", "mean"), default="each",
                    help="the early stop on every fact window's loss (a job's rule) or on their mean (the older "
                         "results files)")
    args = ap.parse_args()
    global FACTS, STOP_RULE
    FACTS = EVAL_FACTS if args.facts == "eval" else tests_facts()
    STOP_RULE = args.stop_rule
    load_start = os.getloadavg()
    rm = ResidentModel(ResidentConfig(n_ctx=512, n_seq=1, n_threads=1))
    probe = DriftProbe(rm, load_anchors(), seq_id=0)            # held out: what the job reports
    # what the regularizer trains, with as many samples as any setting takes
    rehearsal = DriftProbe(rm, rehearsal_anchors(), seq_id=0, samples=MAX_SAMPLES)
    t = time.perf_counter()
    run_steps(probe.record())
    if args.rehearsal_top_k:     # the soft targets' rows wider than the measurement's (drift.TOP_K)
        narrow = decoding.top_k          # looked up where records and samples are made
        decoding.top_k = records.top_k = lambda logp, k=args.rehearsal_top_k: narrow(logp, k)
        try:
            run_steps(rehearsal.record())
        finally:
            decoding.top_k = records.top_k = narrow
    else:
        run_steps(rehearsal.record())
    record_s = time.perf_counter() - t
    unseen = DriftProbe(rm, UNSEEN_PROMPTS, seq_id=0)
    run_steps(unseen.record())
    base_recall, base_answers = recall(rm, None, FACTS)
    results = []
    for name, cfg in GRID.items():
        if args.only and name not in args.only:
            continue
        results.append(run_setting(rm, probe, rehearsal, unseen, name, *cfg, seed=args.seed,
                                   each_epoch=args.each_epoch, noise=args.noise_margin, scales=args.scales,
                                   jitters=args.jitters, save_params=args.save_params))
        Path(args.out).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {os.cpu_count()} cores (shared)",
            "model": rm.model_path.name, "threads": 1, "seed": args.seed, "facts": args.facts,
            "stop_rule": args.stop_rule,
            "anchors": len(probe.bases),
            "rehearsal_anchors": len(rehearsal.bases), "rehearsal_top_k": args.rehearsal_top_k or TOP_K,
            "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
            "unseen_prompts": len(UNSEEN_PROMPTS), "record_s": record_s,
            "base_recall": base_recall, "base_answers": base_answers, "results": results}, indent=1) + "\n")
    rm.close()


if __name__ == "__main__":
    main()
