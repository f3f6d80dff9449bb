"""Write tests/data/streamer/: a small byte-level BPE tokenizer and the pieces transformers' TextStreamer releases
while a generate call streams token sequences through it, for tests/test_streamers.py.

The tokenizer is trained here on a fixed text (words, punctuation, newlines, CJK, an emoji, a special token) and
saved with a tokenizer_config.json; the sequences are encodings of texts, the prompt their first tokens. Each case
records the pieces of ``on_finalized_text`` (put with the prompt [1, T], then one token [1] at a time, then end)
with and without ``skip_prompt`` and with ``skip_special_tokens``.

    /tmp/tfvenv/bin/python tools/make_streamer_reference.py
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, TextStreamer

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "streamer"
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello, world! (parentheses) [brackets] {braces}",
          "line one\nline two\n\n  indented line", "東京は日本の首都です。北京也是首都。", "emoji 😀 and café naïve",
          "def f(x):\n    return x * 2  # code", "12345 3.14 well-known e-mail snake_case"] * 20
TEXTS = ["The quick brown fox, jumps!\nNew line here.", "東京は日本の首都です。 then english words", "emoji 😀 café",
         "def f(x):\n    return x * 2", "<|end|> special then text", "well-known 3.14 (brackets) done."]
PROMPT_TOKENS = 3


class Recording(TextStreamer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pieces = []

    def on_finalized_text(self, text, stream_end=False):
        self.pieces.append([text, stream_end])


def main():
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|end|>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    OUT.mkdir(parents=True, exist_ok=True)
    backend.save(str(OUT / "tokenizer.json"))
    (OUT / "tokenizer_config.json").write_text(json.dumps({"clean_up_tokenization_spaces": False,
                                                           "eos_token": "<|end|>"}, indent=1) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(OUT)
    cases = []
    for text in TEXTS:
        ids = backend.encode(text).ids
        for options in ({"skip_prompt": False}, {"skip_prompt": True},
                        {"skip_prompt": True, "skip_special_tokens": True}):
            streamer = Recording(tokenizer, **options)
            streamer.put(torch.tensor([ids[:PROMPT_TOKENS]]))
            for token in ids[PROMPT_TOKENS:]:
                streamer.put(torch.tensor([token]))
            streamer.end()
            cases.append({"ids": ids, "options": options, "pieces": streamer.pieces})
    (OUT / "pieces.json").write_text(json.dumps({"prompt_tokens": PROMPT_TOKENS, "cases": cases}, ensure_ascii=False,
                                                indent=1) + "\n")


if __name__ == "__main__":
    main()
