"""TextStreamer and TextIteratorStreamer (models/streamers.py) against transformers': the same pieces of text for
token sequences streamed as generate streams them (tests/data/streamer, tools/make_streamer_reference.py: a
byte-level BPE tokenizer, texts with newlines, CJK, an emoji, code and a special token), and both driven by a real
generate call."""
from __future__ import annotations

import json
import threading
from pathlib import Path
from queue import Empty

import numpy as np
import pytest

import vkformers as vkf
from vkformers.errors import InputError
from vkformers.models.loading import AutoModelForCausalLM, AutoTokenizer
from vkformers.models.streamers import TextIteratorStreamer, TextStreamer

DATA = Path(__file__).parent / "data" / "streamer"
REFERENCE = json.loads((DATA / "pieces.json").read_text())


class Recording(TextStreamer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pieces = []

    def on_finalized_text(self, text, stream_end=False):
        self.pieces.append([text, stream_end])


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DATA)


@pytest.mark.parametrize("index", range(len(REFERENCE["cases"])))
def test_the_pieces_are_transformers(tokenizer, index):
    case = REFERENCE["cases"][index]
    streamer = Recording(tokenizer, **case["options"])
    ids, prompt = case["ids"], REFERENCE["prompt_tokens"]
    streamer.put(np.array([ids[:prompt]]))
    for token in ids[prompt:]:
        streamer.put(np.array([token]))
    streamer.end()
    assert streamer.pieces == case["pieces"]


def test_streamers_follow_a_generate_call(tokenizer, capsys):
    """The printed text is the decoded output; the iterator yields it from generate's thread; two rows are refused."""
    model = AutoModelForCausalLM.from_pretrained(Path(__file__).parent / "fixtures" / "llama", requires_grad=False)
    ids = np.array([[5, 17, 22, 9]], np.int64)
    tokens = model.generate(ids, max_new_tokens=12, streamer=TextStreamer(tokenizer, skip_prompt=True))
    assert capsys.readouterr().out == tokenizer.decode(tokens[0, 4:].tolist()) + "\n"
    streamer = TextIteratorStreamer(tokenizer, timeout=60)
    thread = threading.Thread(target=model.generate, args=(ids,), kwargs=dict(max_new_tokens=12, streamer=streamer))
    thread.start()
    text = "".join(streamer)
    thread.join()
    assert text == tokenizer.decode(tokens[0].tolist())
    with pytest.raises(InputError, match="streams one row; generate was given 2"):
        model.generate(np.repeat(ids, 2, axis=0), max_new_tokens=2, streamer=TextStreamer(tokenizer))
    quiet = TextIteratorStreamer(tokenizer, timeout=0.01)
    with pytest.raises(Empty):  # nothing came: a reader learns that generate is not running
        next(quiet)
    assert vkf.TextStreamer is TextStreamer and vkf.TextIteratorStreamer is TextIteratorStreamer
