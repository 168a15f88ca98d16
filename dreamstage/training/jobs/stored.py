"""A JobSpec's stored form, and the upgrade of older forms.

A job's spec is derived once, at submit, and stored with SPEC_VERSION: a
queued job keeps the defaults it was accepted with when a later version
changes them, and a form this code does not know is refused by name.
"""
from __future__ import annotations

import json
from dataclasses import asdict, fields
from typing import Any

from dreamstage.training.jobs.example_forms import FORM_OF_MODEL, PLAIN_FORMS
from dreamstage.training.jobs.spec import JobSpec, PacingSpec, SourcedExample

# The stored form of a JobSpec; bump on any change to it. Each older form reads
# back as it meant when it was accepted (the fields it lacked, as they were then):
# 2 added the drift guard's fields and group_prefix, 3 max_drift_kl, 4 rehearsal and
# consolidate, 5 neighbours, 6 consolidate_decay, 7 a group's completions keep their group and weight
# (form 6 dropped them: a group read back trained as plain examples) and the "tokens" form.
SPEC_VERSION = 7
_V7: dict[str, Any] = {}
_V6 = {"consolidate_decay": False, **_V7}
_V5 = {"neighbours": 0, **_V6}
_V4 = {"rehearsal": "samples", "consolidate": 0, **_V5}
_V3 = {"max_drift_kl": None, **_V4}
_V2 = {"regularizer": False, "anchor_ratio": 0.0, "anchors": (), "stop_loss": None, "group_prefix": False, **_V3}
# what a form lacked, as it meant then
_OLD_MEANING: dict[int, dict[str, Any]] = {1: _V2, 2: _V3, 3: _V4, 4: _V5, 5: _V6, 6: _V7}


def to_stored(spec: JobSpec) -> str:
    """The spec as stored JSON (form SPEC_VERSION)."""
    d = {f.name: getattr(spec, f.name) for f in fields(spec) if f.name not in ("examples", "pacing")}
    d["targets"] = list(spec.targets)
    d["pacing"] = asdict(spec.pacing)
    d["examples"] = [{"source": e.source, "label": e.label, "form": FORM_OF_MODEL[type(e.example).__name__],
                      "example": e.example.model_dump(mode="json", exclude_none=True),
                      **({"group": e.group, "weight": e.weight} if e.group is not None else {})}
                     for e in spec.examples]
    return json.dumps(d, separators=(",", ":"))


def from_stored(text: str, version: int) -> JobSpec:
    """A stored spec of any known form, as it meant when it was accepted."""
    if version not in (*_OLD_MEANING, SPEC_VERSION):
        raise ValueError(f"a job spec stored in form {version}; this dreamstage reads forms 1 to {SPEC_VERSION}")
    d = json.loads(text)
    d.update(_OLD_MEANING.get(version, {}))
    d["targets"] = tuple(d["targets"])
    d["anchors"] = tuple(d.get("anchors", ()))
    d["pacing"] = PacingSpec(**d["pacing"])
    d["examples"] = tuple(SourcedExample(e["source"], e["label"], PLAIN_FORMS[e["form"]].model_validate(e["example"]),
                                         e.get("group"), e.get("weight", 1.0))
                          for e in d["examples"])
    return JobSpec(**d)
