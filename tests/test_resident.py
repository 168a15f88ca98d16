def test_greedy_generation_is_deterministic(resident):
    a = resident.generate_greedy("The capital of France is", 24)
    b = resident.generate_greedy("The capital of France is", 24)
    assert a == b
    assert "Paris" in a


def test_tokenize_detokenize_round_trip(resident):
    for text in ["Hello world", "  leading spaces and\ttabs\n", "unicode: héllo — 東京 🙂",
                 "<|im_start|>user\nhi<|im_end|>"]:
        toks = resident.tokenize(text, add_special=False, parse_special=True)
        assert toks
        assert resident.detokenize(toks, special=True) == text


def test_special_tokens_parse_as_one_token(resident):
    toks = resident.tokenize("<|im_start|>", add_special=False, parse_special=True)
    assert len(toks) == 1
    assert resident.tokenize("<|im_start|>", add_special=False, parse_special=False) != toks


def test_n_gpu_layers_reaches_the_model_config_and_is_validated():
    import pytest

    from dreamstage.cli import build_parser
    from dreamstage.server.settings import ServerSettings
    from dreamstage.serving.resident import ResidentConfig
    args = build_parser().parse_args(["serve", "-ngl", "99"])
    assert args.n_gpu_layers == 99
    assert ServerSettings(n_gpu_layers=args.n_gpu_layers).resident_config().n_gpu_layers == 99
    # no flag: the settings' default, every layer (as llama-server), unless DREAMSTAGE_N_GPU_LAYERS says otherwise
    from dreamstage.cli import serve_settings
    assert serve_settings(build_parser().parse_args(["serve", "--no-train"])).n_gpu_layers == -1
    with pytest.raises(ValueError, match="n_gpu_layers"):
        ResidentConfig(n_gpu_layers="all").validate()


# A model loads (logging through the installed callback) on one thread while another
# process-wide switch of the log callback runs, as a reload beside an adapter load does.
_LOG_SWITCH_RACE = """
import sys, threading, time
from dreamstage import native
from dreamstage.serving import resident
lc = native.llama_cpp()
stop = time.monotonic() + float(sys.argv[2])
def load():
    while time.monotonic() < stop:
        lc.llama_model_free(lc.llama_model_load_from_file(sys.argv[1].encode(), lc.llama_model_default_params()))
loader = threading.Thread(target=load)
loader.start()
while time.monotonic() < stop:
    resident.quiet_native_logs()
loader.join()
"""


def test_switching_the_log_callback_while_a_model_loads_elsewhere_does_not_crash(tiny_model_path):
    """A replaced log callback stays callable: the thread logging through it may
    still be inside it (it crashed the process within a second when each switch made
    a new callback and dropped the old one)."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "DREAMSTAGE_NATIVE_LOG"}   # the callback switched in
    out = subprocess.run([sys.executable, "-c", _LOG_SWITCH_RACE, str(tiny_model_path), "2"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
