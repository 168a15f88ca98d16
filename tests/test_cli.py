"""The command line without a model: the status table, the progress line, and one-line errors.

Job views come from a real JobStore on a fake clock, so the table reads the
same shape the server returns. The end-to-end CLI runs against a live server
are in test_train_api.py.
"""
from __future__ import annotations

import os
import socket

import pytest

from dreamstage import cli
from dreamstage.client.progress import eta_s, format_duration, progress_line
from dreamstage.training.jobs.request import parse_train_request
from dreamstage.training.jobs.store import JobStore


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def store(tmp_path):
    clock = Clock()
    with JobStore(tmp_path, clock=clock) as s:
        s.clock_ = clock
        yield s


def running_job(store, windows: int = 4, epochs: int = 5, epoch: int = 1, window: int = 2, elapsed: float = 60.0):
    req = parse_train_request({"text": "a lesson to learn " * 4, "window": 16, "epochs": epochs, "out": "lesson"})
    jid = store.submit(req)["id"]
    store.transition(jid, "starting")
    store.transition(jid, "running")
    store.clock_.t += elapsed
    store.update_progress(jid, windows=windows, epoch=epoch, window_in_epoch=window)
    return store.get(jid)


def test_eta_is_the_rate_so_far_on_the_servers_clock(store):
    job = running_job(store, windows=4, epochs=5, epoch=1, window=2, elapsed=60.0)
    done, total = 1 * 4 + 2, 4 * 5
    assert eta_s(job) == pytest.approx(60.0 / done * (total - done))
    assert f"ETA {format_duration(60.0 / done * (total - done))}" in progress_line(job)


def test_no_eta_before_the_first_window_or_when_not_running(store):
    job = running_job(store, epoch=0, window=0)
    assert eta_s(job) is None and "ETA" not in progress_line(job)
    store.update_progress(job["id"], window_in_epoch=2)
    assert eta_s(store.get(job["id"])) is not None
    store.transition(job["id"], "paused")
    assert eta_s(store.get(job["id"])) is None


def test_progress_line_shows_loss_and_train_tok_s(store):
    job = running_job(store)
    store.append_receipt(job["id"], {"status": "ok", "loss": 2.5, "tokens": 8, "chunk_tokens": 16, "ms": 500.0})
    store.end_window(job["id"])
    line = progress_line(store.get(job["id"]))
    assert "loss 2.500" in line and "32.0 tok/s" in line     # 16 tokens walked in 0.5 s


@pytest.mark.parametrize("seconds, text", [(None, "-"), (0.4, "0s"), (59, "59s"), (61, "1m01s"), (3725, "1h02m")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_status_is_a_table_of_jobs_and_adapters(store):
    current = running_job(store)
    queued = store.submit(parse_train_request({"text": "another lesson here", "out": "next"}))
    (store.adapters_dir / "lesson").mkdir(parents=True)
    store.add_adapter("lesson", 1, current["id"], 1.25)
    store.promote("lesson", 1)
    out = cli.render_status(store.overview(), {"served_version": 1, "served": store.served(), "served_error": None,
                                               "promotions": store.promotions(), "adapters": store.adapters()})
    lines = out.splitlines()
    assert lines[0] == "serving adapter version 1 (lesson v1)"
    header = next(i for i, line in enumerate(lines) if line.startswith("JOB"))
    cols = lines[header].split()
    assert cols[:3] == ["JOB", "STATE", "DONE"] and "ETA" in cols and "TOK/S" in cols
    first, second = lines[header + 1].split(), lines[header + 2].split()
    assert first[:3] == [str(current["id"]), "running", "30%"] and first[-1] == "lesson"
    assert second[:2] == [str(queued["id"]), "queued"] and second[-1] == "next"
    adapters = lines[lines.index(next(line for line in lines if line.startswith("ADAPTER"))) + 1].split()
    assert adapters == ["lesson", "1", "1.250", str(current["id"]), "v1"]


def test_status_with_nothing_to_show():
    out = cli.render_status({"current": None, "queue": []},
                            {"served_version": 0, "served": None, "served_error": None,
                             "promotions": [], "adapters": []})
    assert out.splitlines() == ["serving adapter version 0 (base model)", "", "no job training or queued"]


# -- errors: one line on stderr, a non-zero exit ----------------------------------------------
def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_is_one_line(capsys):
    url = f"http://127.0.0.1:{unused_port()}"
    assert cli.main(["status", "--url", url]) == 1
    assert one_line(capsys.readouterr().err).startswith(f"dreamstage status: cannot reach {url}")


def test_missing_file_is_one_line(tmp_path, capsys):
    assert cli.main(["train", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl" in one_line(capsys.readouterr().err)


def test_serve_on_a_taken_port_fails_before_loading_the_model(monkeypatch, tmp_path, capsys):
    import dreamstage.server.service as service

    def no_model(*a, **kw):
        raise AssertionError("the model was loaded although the port is taken")

    monkeypatch.setattr(service, "Service", no_model)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--port", str(port), "--state-dir", str(tmp_path)]) == 2
    assert one_line(capsys.readouterr().err).startswith(f"dreamstage serve: cannot listen on 127.0.0.1:{port}")


def test_an_unexpected_error_is_one_line_unless_debugging(monkeypatch, capsys):
    def broken(args):
        raise RuntimeError("the native library is missing")

    monkeypatch.setattr(cli, "cmd_info", broken)
    monkeypatch.delenv("DREAMSTAGE_DEBUG", raising=False)
    assert cli.main(["info"]) == 1
    assert one_line(capsys.readouterr().err) == (
        "dreamstage info: RuntimeError: the native library is missing (DREAMSTAGE_DEBUG=1 shows where)")
    monkeypatch.setenv("DREAMSTAGE_DEBUG", "1")
    with pytest.raises(RuntimeError):
        cli.main(["info"])


def test_a_reader_that_leaves_ends_the_command_quietly(tmp_path):
    """`dreamstage info | head -1`: the closed pipe ends the command with 141, as a
    shell's pipe writer does, and no error line."""
    import subprocess
    import sys
    r, w = os.pipe()
    os.close(r)                                        # the reader is gone before anything is written
    p = subprocess.run([sys.executable, "-m", "dreamstage.cli", "info"], stdout=w, stderr=subprocess.PIPE,
                       timeout=120, cwd=tmp_path)
    os.close(w)
    assert p.returncode == 141 and p.stderr == b"", p.stderr.decode()


# -- serve's settings: flags, then DREAMSTAGE_* variables, then the defaults ------------------
def serve_args(*flags):
    return cli.build_parser().parse_args(["serve", *flags])


def test_serve_settings_take_flags_over_the_environment_over_the_defaults(monkeypatch, tmp_path):
    from dreamstage.server.settings import ServerSettings

    for name in ("PORT", "STATE_DIR", "API_KEY", "LIMITS__MAX_QUEUED_JOBS", "ALLOWED_HOSTS"):
        monkeypatch.delenv(f"DREAMSTAGE_{name}", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    plain = cli.serve_settings(serve_args())
    assert plain.port == ServerSettings.model_fields["port"].default == 8080
    assert plain.state_dir == str(tmp_path / "xdg" / "dreamstage")          # the default state directory
    monkeypatch.setenv("DREAMSTAGE_PORT", "9001")
    monkeypatch.setenv("DREAMSTAGE_STATE_DIR", str(tmp_path / "env-state"))
    monkeypatch.setenv("DREAMSTAGE_LIMITS__MAX_QUEUED_JOBS", "3")
    monkeypatch.setenv("DREAMSTAGE_ALLOWED_HOSTS", '["box.lan"]')
    env = cli.serve_settings(serve_args("--max-job-tokens", "5000"))
    assert (env.port, env.state_dir, env.allowed_hosts) == (9001, str(tmp_path / "env-state"), ("box.lan",))
    assert (env.limits.max_queued_jobs, env.limits.max_job_tokens) == (3, 5000)   # both sources, merged
    flags = cli.serve_settings(serve_args("--port", "9002", "--no-train", "--allowed-host", "a.lan"))
    assert (flags.port, flags.state_dir, flags.allowed_hosts) == (9002, None, ("a.lan",))


def test_a_bad_setting_from_the_environment_is_one_line_naming_it(monkeypatch, capsys):
    import dreamstage.server.service as service

    monkeypatch.setattr(service, "Service", lambda *a, **kw: pytest.fail("the model was loaded"))
    monkeypatch.setenv("DREAMSTAGE_PORT", "70000")
    assert cli.main(["serve", "--no-train"]) == 2
    assert one_line(capsys.readouterr().err) == "dreamstage serve: port: Input should be less than or equal to 65535"
    monkeypatch.setenv("DREAMSTAGE_PORT", "8080")
    monkeypatch.setenv("DREAMSTAGE_PARALLEL", "8")
    assert cli.main(["serve", "--no-train", "--ctx", "64"]) == 2
    assert one_line(capsys.readouterr().err) == ("dreamstage serve: ctx 64 leaves fewer than 16 tokens per slot "
                                                 "for 8 slots")


def test_every_subcommand_prints_its_help():
    """argparse formats help strings with %: a stray one crashes --help."""
    import argparse

    from dreamstage.cli import build_parser
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert "serve" in subs.choices
    for name, sub in subs.choices.items():
        text = sub.format_help()
        assert name in text and "usage" in text
    assert "usage" in parser.format_help()
    assert "25% of the free memory" in subs.choices["serve"].format_help().replace("\n", " ").replace("  ", " ")
