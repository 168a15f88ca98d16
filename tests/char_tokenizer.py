"""A tokenizer for tests without a model: one token per character (id = code point + 16), BOS 1, EOS 2.

It follows the tokenizer protocol `render_job` needs (training-control.md,
"The tokenizer protocol"); no chat template, so chats use the fallback.
"""
from __future__ import annotations

import time


class CharTokenizer:
    bos, eos = 1, 2

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s            # a slow render widens the window concurrent submissions race in

    def tokenize(self, text, add_special=True, parse_special=True):
        if self.delay_s:
            time.sleep(self.delay_s)
        return ([self.bos] if add_special else []) + [ord(c) + 16 for c in text]

    def detokenize(self, tokens, special=False):
        return "".join(chr(t - 16) for t in tokens if t >= 16)

    def chat_template(self):
        return None

    def is_eog(self, t):
        return t == self.eos
