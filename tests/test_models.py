import pytest

from dreamstage.models import ModelFileError, check_model_file, default_model
from dreamstage.resident import ResidentConfig, ResidentModel


def test_default_model_is_embedded_gguf():
    p = default_model()
    assert p.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert p.stat().st_size > 50_000_000


def test_default_model_loads(resident):
    assert resident.n_vocab == 49152
    assert resident.meta("general.architecture") == "llama"
    assert "im_start" in (resident.chat_template() or "")


def test_missing_model_named(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelFileError, match="nope.gguf"):
        check_model_file(missing)


def test_not_gguf_named(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(ModelFileError, match="bad.gguf.*not a GGUF"):
        ResidentModel(ResidentConfig(model_path=str(bad)))


def test_truncated_gguf_named(tmp_path):
    src = default_model().read_bytes()[: 1 << 20]
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(src)
    with pytest.raises(ValueError, match="truncated.gguf"):
        ResidentModel(ResidentConfig(model_path=str(bad)))


@pytest.mark.parametrize("field,value", [("n_ctx", 0), ("kv_type", "q3_x"), ("flash_attn", "maybe")])
def test_bad_config_named(field, value):
    with pytest.raises(ValueError, match=field):
        ResidentConfig(**{field: value}).validate()
