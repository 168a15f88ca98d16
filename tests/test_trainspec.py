"""The POST /train body: every field validated, bad input refused by name."""
import json

import pytest
from pydantic import ValidationError

from dreamstage.training.jobs.example_forms import ChatExample, PromptCompletion, TextExample
from dreamstage.training.jobs.request import (
    TrainRequest,
    check_adapter_name,
    context_cache_types,
    parse_train_request,
)
from dreamstage.training.jobs.spec import DEFAULT_CONTEXT_CACHE_TYPE, default_overlap
from dreamstage.training.jobs.store import STARTING_FIELDS

CHAT = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}



def starting_fields(spec) -> dict:
    """The shape a job records from its `starting` moment on (the store's columns)."""
    return {k: getattr(spec, k) for k in STARTING_FIELDS}

def refusal(body) -> list[tuple[tuple, str]]:
    with pytest.raises(ValidationError) as e:
        parse_train_request(body)
    return [(err["loc"], err["msg"]) for err in e.value.errors()]


def test_defaults_resolve_into_the_job_spec():
    spec = parse_train_request({"text": "hello world"}).to_job_spec()
    assert spec.window == 512 and spec.chunk == 128 and spec.overlap == 64
    assert spec.context_cache_type == "q8_0" and spec.fit == "middle"
    assert spec.recompute is False and spec.exact is False and spec.horizon is None
    assert spec.targets == ("attn_q", "attn_v") and spec.rank == 8 and spec.alpha == 16.0
    assert (spec.pacing.mode, spec.pacing.value) == ("max_slowdown", 0.10)
    assert spec.promote == "manual" and spec.out is None
    assert starting_fields(spec) == {"context_cache_type": "q8_0", "chunk": 128, "recompute": False,
                                      "exact": False, "horizon": None, "window": 512}


def test_chunk_default_is_clipped_to_a_small_window():
    spec = parse_train_request({"text": "x", "window": 32}).to_job_spec()
    assert spec.chunk == 32 and spec.overlap == default_overlap(32) == 4 and spec.min_chunk == 16


def test_four_example_forms_and_groups_flatten_with_their_source():
    body = {
        "text": "a long text",
        "examples": [
            {"text": "t"},
            {"prompt": "p", "completion": "c"},
            CHAT,
            {"prompt": "p", "completions": ["x", "y"]},
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "old"}],
             "completions": ["r1", "r2"]},
        ],
    }
    spec = parse_train_request(body).to_job_spec()
    kinds = [type(s.example) for s in spec.examples]
    assert kinds == [TextExample, TextExample, PromptCompletion, ChatExample,
                     PromptCompletion, PromptCompletion, ChatExample, ChatExample]
    assert [s.source for s in spec.examples] == [0, 1, 2, 3, 4, 4, 5, 5]
    assert spec.examples[5].label == "examples[3].completions[1]"
    # A messages group: the prefix is context, each completion one trained reply.
    group_chat = spec.examples[6].example
    assert [m.trained for m in group_chat.messages] == [False, False, True]
    assert group_chat.messages[-1].content == "r1"


def test_unknown_fields_are_refused_by_name_at_every_level():
    assert refusal({"text": "x", "walk_horizon": 4})[0][0] == ("walk_horizon",)
    errs = refusal({"examples": [{"prompt": "p", "completion": "c", "weight": 2}]})
    assert errs[0][0][-1] == "weight"
    errs = refusal({"examples": [{"messages": [{"role": "user", "content": "q", "lang": "en"},
                                               {"role": "assistant", "content": "a"}]}]})
    assert errs[0][0][-1] == "lang"


def test_unknown_context_cache_type_is_refused_naming_the_value():
    (loc, msg), = refusal({"text": "x", "context_cache_type": "q5_1"})
    assert loc == ("context_cache_type",) and "'q5_1'" in msg
    (loc, msg), = refusal({"text": "x", "context_cache_type": "q5_k"})
    assert loc == ("context_cache_type",) and "'q5_k'" in msg
    for ok in context_cache_types():
        assert parse_train_request({"text": "x", "context_cache_type": ok}).context_cache_type == ok


def test_the_cache_types_are_the_native_cores():
    """The body's check and its JSON schema read dream_context_cache_types, not a list of their own."""
    from dreamstage import native

    supported = native.context_cache_types()
    assert set(supported) == {"q8_0", "q4_0", "f16", "f32"}           # what dream-memory.cpp builds caches in
    assert context_cache_types() == supported and DEFAULT_CONTEXT_CACHE_TYPE in supported
    (_, msg), = refusal({"text": "x", "context_cache_type": "bf16"})
    assert msg.endswith("is not one of " + ", ".join(supported))
    schema = TrainRequest.model_json_schema()["properties"]["context_cache_type"]
    assert schema["enum"] == list(supported) and schema["default"] == DEFAULT_CONTEXT_CACHE_TYPE


def test_the_exact_walk_its_horizon_and_recompute_are_accepted():
    spec = parse_train_request({"text": "x", "exact": True, "window": 64, "horizon": 32,
                                "recompute": True}).to_job_spec()
    assert spec.exact is True and spec.horizon == 32 and spec.recompute is True
    assert starting_fields(spec)["exact"] is True and starting_fields(spec)["horizon"] == 32
    assert parse_train_request({"text": "x", "exact": True}).horizon is None   # the whole window


@pytest.mark.parametrize("body, field, words", [
    ({"window": 8}, "window", "greater than or equal to 16"),
    ({"window": 64, "chunk": 65}, "chunk", "larger than window 64"),
    ({"chunk": 0}, "chunk", "greater than or equal to 1"),
    ({"window": 64, "overlap": 33}, "overlap", "more than half"),
    ({"horizon": 8}, "horizon", "exact=true"),
    ({"rank": 0}, "rank", "greater than or equal to 1"),
    ({"rank": 257}, "rank", "less than or equal to 256"),
    ({"alpha": 0}, "alpha", "greater than 0"),
    ({"lr": 0}, "lr", "greater than 0"),
    ({"lr": -1e-3}, "lr", "greater than 0"),
    ({"epochs": 0}, "epochs", "greater than or equal to 1"),
    ({"val_split": 1.0}, "val_split", "less than 1"),
    ({"val_split": -0.1}, "val_split", "greater than or equal to 0"),
    ({"seed": -1}, "seed", "greater than or equal to 0"),
    ({"memory_budget_mib": 0}, "memory_budget_mib", "greater than 0"),
    ({"memory_budget_mib": 1}, "memory_budget_mib", "not above the memory gate's slack of 64 MiB"),
    ({"memory_budget_mib": 64}, "memory_budget_mib", "give more than 64"),
    ({"max_pause_ms": -1}, "max_pause_ms", "greater than or equal to 0"),
    ({"max_pause_ms": 1e7}, "max_pause_ms", "less than or equal to 600000"),
    ({"max_pause_ms": "fast"}, "max_pause_ms", "valid number"),
    ({"top_layers": 0}, "top_layers", "greater than or equal to 1"),
    ({"share": 1.0}, "share", "less than 1"),
    ({"max_slowdown": 0}, "max_slowdown", "greater than 0"),
    ({"share": 0.2, "max_slowdown": 0.1}, "max_slowdown", "exclusive"),
    ({"promote": "always"}, "promote", "'never', 'manual' or 'auto'"),
    ({"fit": "right"}, "fit", "'middle' or 'left'"),
    ({"targets": "attn_q,mlp"}, "targets", "'mlp'"),
    ({"targets": ["attn_q", "attn_q"]}, "targets", "twice"),
    ({"targets": ""}, "targets", "empty"),
    ({"window": "512"}, "window", "valid integer"),
    ({"recompute": 0}, "recompute", "valid boolean"),
    ({"out": "../escape"}, "out", "bare adapter name"),
    ({"out": "a/b"}, "out", "bare adapter name"),
    ({"out": ".hidden"}, "out", "bare adapter name"),
])
def test_every_malformed_field_is_named(body, field, words):
    errs = refusal({"text": "x", **body})
    assert any(loc == (field,) and words in msg for loc, msg in errs), errs


@pytest.mark.parametrize("example, tail, words", [
    ({"foo": 1}, (), "an example is an object with one of"),
    ("just a string", (), "an example is an object"),
    ({"prompt": "p", "completion": ""}, ("completion",), "at least 1 character"),
    ({"prompt": "p"}, ("completion",), "Field required"),
    ({"messages": []}, ("messages",), "at least 1 item"),
    ({"messages": [{"role": "bot", "content": "a"}]}, ("messages", 0, "role"), "'bot'"),
    ({"messages": [{"role": "user", "content": "q", "train": True}, {"role": "assistant", "content": "a"}]},
     ("messages", 0), "only assistant turns carry loss"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "train": False}]},
     (), "no trained assistant message"),
    ({"messages": [{"role": "user"}]}, ("messages", 0), "needs content"),
    ({"prompt": "p", "completions": []}, ("completions",), "at least 1 item"),
    ({"prompt": "p", "completions": ["a", ""]}, (), "completions[1] is empty"),
    ({"prompt": "p", "messages": CHAT["messages"], "completions": ["a"]}, (), "exactly one of prompt or messages"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "train": True}],
      "completions": ["b"]}, (), "a group's messages are context"),
])
def test_malformed_examples_are_located(example, tail, words):
    errs = refusal({"examples": [{"text": "fine"}, example]})
    hits = [(loc, msg) for loc, msg in errs if loc[:2] == ("examples", 1) and words in msg]
    assert hits, errs
    assert any(loc[-len(tail):] == tail if tail else True for loc, _ in hits)


def test_an_empty_body_is_refused():
    (loc, msg), = refusal({})
    assert "text or a non-empty examples list" in msg
    assert "text or a non-empty" in refusal({"examples": []})[0][1]


def test_raw_json_bodies_validate_strictly():
    req = parse_train_request(json.dumps({"text": "x", "lr": 1, "share": 0.25}))
    assert req.lr == 1.0 and req.to_job_spec().pacing.mode == "share"
    assert refusal('{"text": "x", "epochs": 1.5}')[0][0] == ("epochs",)
    # a dict, as FastAPI passes
    assert parse_train_request({"text": "x", "alpha": 32, "max_slowdown": 0.2}).alpha == 32.0


def test_targets_accept_a_comma_list_or_a_list_in_canonical_order():
    a = parse_train_request({"text": "x", "targets": "ffn_down, attn_q"}).to_job_spec()
    b = parse_train_request({"text": "x", "targets": ["attn_q", "ffn_down"]}).to_job_spec()
    assert a.targets == b.targets == ("attn_q", "ffn_down")
    assert a.lora_fields() == {"rank": 8, "alpha": 16.0, "targets": "attn_q,ffn_down", "top_layers": 0, "seed": 0}
    assert parse_train_request({"text": "x", "top_layers": 4}).to_job_spec().lora_fields()["top_layers"] == 4


def test_the_request_round_trips_through_json_for_persistence():
    body = {"examples": [CHAT, {"prompt": "p", "completions": ["x"]}], "window": 64, "share": 0.3, "out": "facts"}
    req = parse_train_request(body)
    again = parse_train_request(json.dumps(req.model_dump(mode="json", exclude_none=True)))
    assert again.to_job_spec() == req.to_job_spec()


@pytest.mark.parametrize("name", ["facts", "facts-v2", "my_adapter.1", "A"])
def test_bare_adapter_names_pass(name):
    assert check_adapter_name(name) == name


@pytest.mark.parametrize("name", ["", "a/b", "..", "a..b", "/abs", "x" * 65, "trailing.", "sp ace", "nul\x00"])
def test_unsafe_adapter_names_fail(name):
    with pytest.raises(ValueError, match="bare adapter name"):
        check_adapter_name(name)


def test_python_callers_may_pass_models():
    req = TrainRequest(examples=[PromptCompletion(prompt="p", completion="c")])
    assert isinstance(req.to_job_spec().examples[0].example, PromptCompletion)


def test_max_pause_ms_defaults_to_250_and_zero_means_no_bound():
    assert parse_train_request({"text": "x"}).to_job_spec().pacing.max_pause_ms == 250.0
    assert parse_train_request({"text": "x", "max_pause_ms": 80}).to_job_spec().pacing.max_pause_ms == 80.0
    spec = parse_train_request({"text": "x", "share": 0.2, "max_pause_ms": 0}).to_job_spec()
    assert spec.pacing.mode == "share" and spec.pacing.max_pause_ms is None


# -- weighted groups (issue 10) -----------------------------------------------------
def test_group_completions_take_text_or_message_and_a_weight():
    spec = parse_train_request({"examples": [
        {"prompt": "Q?", "completions": ["plain", {"text": "a", "weight": -0.5}, {"text": "b", "weight": 2}]},
        {"messages": [{"role": "user", "content": "hi"}],
         "completions": [{"message": {"role": "assistant", "content": "hello"}, "weight": 0.25}, {"text": "hey"}]},
    ], "group_prefix": True}).to_job_spec()
    got = [(s.label, s.group, s.weight) for s in spec.examples]
    assert got == [("examples[0].completions[0]", "examples[0]", 1.0),
                   ("examples[0].completions[1]", "examples[0]", -0.5),
                   ("examples[0].completions[2]", "examples[0]", 2.0),
                   ("examples[1].completions[0]", "examples[1]", 0.25),
                   ("examples[1].completions[1]", "examples[1]", 1.0)]
    assert spec.examples[1].example.completion == "a"
    assert [m.content for m in spec.examples[3].example.messages] == ["hi", "hello"]
    assert spec.examples[4].example.messages[-1].role == "assistant" and spec.group_prefix


@pytest.mark.parametrize("completion, field, words", [
    ({"text": "x", "weight": float("inf")}, "weight", "finite"),
    ({"text": "x", "weight": "1"}, "weight", "valid number"),
    ({"weight": 1.0}, None, "exactly one of text or message"),
    ({"text": "x", "message": {"role": "assistant", "content": "y"}}, None, "exactly one of text or message"),
    ({"text": ""}, "text", "text is empty"),
    ({"text": "x", "score": 1}, "score", "Extra inputs"),
    ({"message": {"role": "user", "content": "y"}}, "message", "not 'assistant'"),
    ({"message": {"role": "assistant", "content": "y", "train": False}}, "message", "train=false"),
])
def test_bad_completions_are_refused_naming_the_field(completion, field, words):
    body = {"examples": [{"messages": [{"role": "user", "content": "hi"}], "completions": ["ok", completion]}]}
    with pytest.raises(ValidationError) as e:
        parse_train_request(body)
    first = e.value.errors()[0]
    assert first["loc"][:5] == ("examples", 0, "group", "completions", 1)
    if field:
        assert first["loc"][-1] == field
    assert words in first["msg"]


def test_groups_refuse_a_horizon_and_a_prompt_group_refuses_messages():
    with pytest.raises(ValidationError, match="horizon") as e:
        parse_train_request({"examples": [{"prompt": "Q", "completions": ["a"]}], "exact": True, "horizon": 8})
    assert e.value.errors()[0]["loc"] == ("horizon",)
    with pytest.raises(ValidationError) as e:
        parse_train_request({"text": "some text", "exact": True, "horizon": 8, "group_prefix": True})
    assert e.value.errors()[0]["loc"] == ("group_prefix",)
    with pytest.raises(ValidationError, match="belongs to a messages group"):
        reply = {"message": {"role": "assistant", "content": "a"}}
        parse_train_request({"examples": [{"prompt": "Q", "completions": [reply]}]})
