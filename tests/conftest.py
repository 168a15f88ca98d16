import json
import os
from pathlib import Path

import pytest

# The modules that take the most worker time, longest first. dev.sh runs each
# file whole on one worker, in collection order (--dist loadfile
# --no-loadscope-reorder): a long module handed out last would run alone at the
# end, so these are collected first and the short ones fill in beside them.
# test_drift_readme.py starts on the records test_drift_jobs.py hands over
# after its warm-up (tests/drift_jobs.py), about 2 CPU-minutes in: the
# modules before it take the other worker about as long, so it waits little.
LONGEST_FIRST = (
    "test_drift_jobs.py", "test_fuzz.py", "test_compat.py", "test_first_job.py", "test_feedback.py",
    "test_drift.py", "test_drift_readme.py", "test_rpc.py", "test_example_scripts.py", "test_train_api.py",
    "test_hostile.py", "test_faults.py", "test_rpc_abort.py", "test_dashboard.py", "test_neighbours.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: a module's own order stays



@pytest.fixture(scope="session", autouse=True)
def _no_server_settings_from_the_environment():
    """Test servers get the settings their test gives: a DREAMSTAGE_PORT or
    DREAMSTAGE_API_KEY in the developer's shell must not reach them (the CLI
    tests that mean to read the environment set it themselves)."""
    from dreamstage.server.settings import ServerSettings

    names = [f"DREAMSTAGE_{field.upper()}" for field in ServerSettings.model_fields]
    saved = {k: v for k, v in os.environ.items()
             if k in names or k.startswith("DREAMSTAGE_LIMITS__")}
    for k in saved:
        del os.environ[k]
    # The drift guard records the base's answers on the anchor prompts once per
    # server (about half a minute on two cores), measures every finished job
    # against them, and its regularizer adds anchor windows to each epoch.
    # Test servers that are not about drift run without it; set here, after the
    # developer's settings are cleared, so that it holds for every server the
    # session builds (tests/test_drift.py drives its own guard explicitly).
    os.environ["DREAMSTAGE_DRIFT_GUARD"] = "false"
    yield
    del os.environ["DREAMSTAGE_DRIFT_GUARD"]
    os.environ.update(saved)


@pytest.fixture
def record_result(tmp_path):
    """Write a test's measured figures as JSON (name -> path written).

    Into tmp_path: a test run never rewrites the tracked files under
    bench/results/. To refresh those, name the directory explicitly:
    DREAMSTAGE_RECORD_RESULTS=bench/results pytest tests/test_trainer.py
    """
    out = Path(os.environ.get("DREAMSTAGE_RECORD_RESULTS") or tmp_path / "results")

    def record(name: str, data: dict) -> Path:
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{name}.json"
        path.write_text(json.dumps(data, indent=2) + "\n")
        assert json.loads(path.read_text()) == data      # what a reader of the file gets is what was measured
        return path

    return record


@pytest.fixture(scope="session")
def resident():
    """The default model, resident once per session (single sequence). One
    thread, like every model the suite builds: dev.sh runs one test worker per
    core, and ggml's spinning thread barrier collapses when threads outnumber
    free cores."""
    from dreamstage.serving.resident import ResidentConfig, ResidentModel
    m = ResidentModel(ResidentConfig(n_ctx=1024, n_seq=1, n_threads=1))
    yield m
    m.close()


@pytest.fixture(scope="session")
def dream_resident():
    """The default model for the dream-stage tests, one thread (see `resident`;
    a 41-token prefill took 2.6 s with 2 threads at load 5, 0.45 s with 1)."""
    from dreamstage.serving.resident import ResidentConfig, ResidentModel
    m = ResidentModel(ResidentConfig(n_ctx=512, n_seq=1, n_threads=1))
    yield m
    m.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A session directory holding the generated tiny llama GGUFs (tests/tiny_model.py)."""
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_model_path(tiny_model_dir):
    """The tiny F32 llama GGUF with the default model's tokenizer, generated once per session."""
    from tiny_model import write_tiny_model
    return write_tiny_model(tiny_model_dir, quant="f32")


@pytest.fixture(scope="session")
def tiny_model_q8_path(tiny_model_dir):
    """The same tiny model with its block matrices in Q8_0, generated once per session."""
    from tiny_model import write_tiny_model
    return write_tiny_model(tiny_model_dir, quant="q8_0")


@pytest.fixture(scope="module")
def tiny_resident(tiny_model_path):
    """The tiny model resident with an F32 K/V cache and no flash attention (a pure F32 forward).

    One thread, as dream_resident explains: ggml's spinning barrier
    collapses when the two shared cores are contended.
    """
    from dreamstage.serving.resident import ResidentConfig, ResidentModel
    m = ResidentModel(ResidentConfig(model_path=str(tiny_model_path), n_ctx=256, n_seq=1,
                                     n_threads=1, kv_type="f32", flash_attn="off"))
    yield m
    m.close()
