"""examples/: the scripts run against a fresh server and print what examples/README.md shows.

The default model, CPU, one thread. teach_facts.py trains for about 20 s on
the project machine (the defaults' early stop ends it); export_adapter.py then loads its adapter in
llama-cpp-python and must get the same answers.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from background_server import BackgroundServer

from dreamstage.server.settings import ServerSettings
from dreamstage.training.jobs.spec import DEFAULT_STOP_LOSS

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))
from teach_facts import QUESTIONS  # noqa: E402

ANSWERS = ["Quokka-42", "Ada Brightwater", "blue potatoes"]   # from examples/data/moonbase_chat.jsonl


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    settings = ServerSettings(ctx=1024, parallel=3, threads=1, state_dir=str(tmp_path_factory.mktemp("state")))
    with BackgroundServer(settings) as srv:
        yield srv


def run(server, *args, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "DREAMSTAGE_URL": server.url}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def test_teach_facts_then_export_the_adapter(server, tmp_path):
    r = run(server, str(EXAMPLES / "teach_facts.py"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    before, after = r.stdout.split("\nafter:\n")
    for question, answer in zip(QUESTIONS, ANSWERS, strict=True):
        assert question in before and question in after
        assert answer not in before                      # the base model does not know
    assert after.count("[adapter v1]") == len(QUESTIONS)
    assert all(a in after for a in ANSWERS), after
    assert "promoted as served version 1" in r.stdout and "stopped after epoch" in r.stdout
    (line,) = [x for x in before.splitlines() if x.startswith("examples' loss per epoch: ")]
    own = [float(x) for x in line.split(": ")[1].split()]       # the guard is off here: no rehearsal-only epochs
    assert own[-1] < DEFAULT_STOP_LOSS < own[0] / 10
    assert "ETA" in r.stderr and "tok/s" in r.stderr      # the progress line

    out = tmp_path / "moonbase.gguf"
    e = run(server, str(EXAMPLES / "export_adapter.py"), "--out", str(out),
            "--state-dir", server.service.settings.state_dir, cwd=tmp_path)
    assert e.returncode == 0, e.stdout + e.stderr[-2000:]
    assert e.stdout.count("same: ") == len(QUESTIONS) and "all answers equal" in e.stdout
    assert out.read_bytes()[:4] == b"GGUF"


def test_two_agents_answer_their_own_secret_in_one_batch_while_a_third_adapter_trains(server, tmp_path):
    r = run(server, str(EXAMPLES / "many_adapters.py"), "--agents", "2", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    lines = r.stdout.splitlines()
    for name, secret in (("agent-1", "Quokka-42"), ("agent-2", "Walrus-17")):
        (line,) = [x for x in lines if x.strip().startswith(name + " ")]
        assert "ok" in line and secret in line.split("(taught")[0]
    (base,) = [x for x in lines if x.strip().startswith("base ")]
    assert "Quokka-42" not in base and "Walrus-17" not in base
    (summary,) = [x for x in lines if x.startswith("asked 3 at once")]
    assert "was running" in summary
    assert int(summary.split(": ")[1].split()[0]) >= 1      # a batch decoded more than one adapter
