def test_greedy_generation_is_deterministic(resident):
    a = resident.generate_greedy("The capital of France is", 24)
    b = resident.generate_greedy("The capital of France is", 24)
    assert a == b
    assert "Paris" in a


def test_tokenize_detokenize_round_trip(resident):
    for text in ["Hello world", "  leading spaces and\ttabs\n", "unicode: héllo — 東京 🙂", "<|im_start|>user\nhi<|im_end|>"]:
        toks = resident.tokenize(text, add_special=False, parse_special=True)
        assert toks
        assert resident.detokenize(toks, special=True) == text


def test_special_tokens_parse_as_one_token(resident):
    toks = resident.tokenize("<|im_start|>", add_special=False, parse_special=True)
    assert len(toks) == 1
    assert resident.tokenize("<|im_start|>", add_special=False, parse_special=False) != toks
