import pytest


@pytest.fixture(scope="session")
def resident():
    """The default model, resident once for the whole session (single sequence)."""
    from dreamstage.resident import ResidentConfig, ResidentModel
    m = ResidentModel(ResidentConfig(n_ctx=1024, n_seq=1, n_threads=2))
    yield m
    m.close()
