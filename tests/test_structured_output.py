"""Structured outputs (models/structured_output.py): the grammar engine reads each token as its bytes (byte-level BPE
and SentencePiece vocabularies), never lets a special token into the text, refuses a bad schema with a one-line
InputError; the scheduler keeps JSON-mode and schema requests to their grammar (greedy and seeded, beside a plain
row that goes on as alone), and ``generate`` takes the same through GrammarLogitsProcessor. On the tiny random
Llama of tests/data/pipeline (byte-level BPE); a bias of -100 on whitespace tokens keeps its JSON short."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from structured_checks import PERSON, blank_tokens, schema_errors
from test_serve import wait_for

from vkformers.errors import InputError, VkformersError
from vkformers.models import gguf as vkgguf
from vkformers.models.batching import BatchScheduler, Request, SamplingParams
from vkformers.models.loading import AutoModelForCausalLM, AutoTokenizer
from vkformers.models.structured_output import (GrammarError, GrammarLogitsProcessor, GrammarVocabulary,
                                                TokenConstraint, any_object_grammar, cfg_grammar, choice_grammar,
                                                closed_objects, json_schema_grammar, regex_grammar)

MODEL = Path(__file__).parent / "data" / "pipeline"


@pytest.fixture(scope="module")
def tiny():
    return (AutoModelForCausalLM.from_pretrained(MODEL, dtype="float32", requires_grad=False),
            AutoTokenizer.from_pretrained(MODEL))


def sentencepiece_tokenizer():
    """A SentencePiece-style vocabulary (U+2581 for spaces, <0xNN> byte pieces, <unk>), as a GGUF describes one."""
    pieces = ["\u2581", "h", "e", "l", "o", "{", "}", '"', ":", "a", "\u2581hello", "\u2581{", '{"', '":', "\u2581\""]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    meta = {"general.architecture": "llama", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(pieces))],
            "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces),
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}
    return vkgguf.tokenizer_from_metadata(meta)


def bundled_tokenizer():
    from vkformers.cli import generate as cli_generate
    return AutoTokenizer.from_pretrained(cli_generate.default_model())


TEXT = 'hello {"a": "héllo wörld 日本"}'


@pytest.mark.parametrize("make, space", [(lambda: AutoTokenizer.from_pretrained(MODEL), ""),
                                         (bundled_tokenizer, ""), (sentencepiece_tokenizer, " ")],
                         ids=["byte-level", "smollm2", "sentencepiece"])
def test_tokens_are_read_as_their_bytes_and_special_tokens_are_never_text(make, space):
    """The engine's bytes of a text's tokens are the text's UTF-8 (a SentencePiece text starts with its U+2581
    space); special tokens and the unknown token stand outside the text."""
    tokenizer = make()
    vocabulary = GrammarVocabulary(tokenizer, len(tokenizer) + 3)  # a model may have more rows than tokens
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert vocabulary.engine.decode_bytes(ids) == (space + TEXT).encode()
    specials = set(tokenizer.all_special_ids) | {tokenizer.unk_token_id} - {None}
    assert specials and not vocabulary.text_tokens[sorted(specials)].any()
    assert vocabulary.text_tokens[ids].all() and not vocabulary.text_tokens[len(tokenizer):].any()


def test_a_character_split_over_byte_tokens_continues_a_json_string():
    """"é" is two byte pieces in the SentencePiece vocabulary: after the first the mask allows the second (a
    token's text decoded alone would be U+FFFD), and the object closes, then only the end token may follow."""
    tokenizer = sentencepiece_tokenizer()
    constraint = TokenConstraint(GrammarVocabulary(tokenizer, len(tokenizer)), any_object_grammar(), [2])
    ids = tokenizer('{"a":"é"}', add_special_tokens=False)["input_ids"]
    ids = [tokenizer.convert_tokens_to_ids("{")] + ids[1:]  # (not "\u2581{": no blank before the object)
    assert tokenizer.convert_ids_to_tokens(ids)[5:7] == ["<0xC3>", "<0xA9>"]
    for token in ids:
        allowed = constraint.allowed()
        assert allowed[token] and not allowed[2], tokenizer.convert_ids_to_tokens([token])
        constraint.advance(token)
    assert constraint.complete and np.flatnonzero(constraint.allowed()).tolist() == [2]
    first = TokenConstraint(constraint.vocabulary, any_object_grammar(), [2]).allowed()
    assert first[tokenizer.convert_tokens_to_ids("{")] and not first[tokenizer.convert_tokens_to_ids("\u2581{")]


@pytest.mark.parametrize("schema, words", [({"type": "foo"}, "Invalid type"),
                                           ({"properties": {"a": {"$ref": "#/$defs/none"}}}, "does not exist"),
                                           ({"type": "string", "pattern": "(("}, "regex parse error"),
                                           ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "Unsatisfiable"),
                                           ({"type": "integer", "minimum": 5, "maximum": 2}, "minimum"),
                                           ([1, 2], "must be an object"), ("{not json", "cannot be read")])
def test_a_schema_the_engine_cannot_compile_is_a_one_line_input_error(schema, words):
    with pytest.raises(GrammarError, match=words) as caught:
        json_schema_grammar(schema)
    assert isinstance(caught.value, InputError) and "\n" not in str(caught.value)


@pytest.mark.parametrize("make, value, words", [(regex_grammar, "a(?=b)", "look-around"),
                                                (regex_grammar, None, "must be a string"),
                                                (choice_grammar, [], "non-empty list"),
                                                (choice_grammar, "ab", "non-empty list"),
                                                (cfg_grammar, 'root ::= "a" rest', "rest"),
                                                (cfg_grammar, "start: a\na: b", "unknown name"),
                                                (cfg_grammar, 3, "must be a string")])
def test_a_regex_choice_list_or_grammar_the_engine_cannot_take_is_a_one_line_input_error(make, value, words):
    with pytest.raises(GrammarError, match=words) as caught:
        make(value)
    assert isinstance(caught.value, InputError) and "\n" not in str(caught.value)


def test_closed_objects_closes_every_object_the_schema_leaves_open():
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"properties": {"b": {}}}},
                                               "c": {"type": "object", "additionalProperties": {"type": "integer"}}},
              "$defs": {"d": {"anyOf": [{"type": "object"}, {"type": "string"}]}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["items"]["additionalProperties"] is False
    assert closed["properties"]["c"]["additionalProperties"] == {"type": "integer"}  # (given: kept)
    assert closed["$defs"]["d"]["anyOf"] == [{"type": "object", "additionalProperties": False}, {"type": "string"}]
    assert "additionalProperties" not in schema  # (a copy)


def test_strict_refuses_what_it_cannot_enforce_and_non_strict_ignores_it():
    schema = {"type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}
    with pytest.raises(GrammarError, match="Unknown format"):
        json_schema_grammar(schema, strict=True)
    assert json_schema_grammar(schema, strict=False)


def test_without_llguidance_structured_outputs_say_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # (an import of it raises ImportError)
    with pytest.raises(VkformersError, match=r"pip install 'vkformers\[serve\]'"):
        json_schema_grammar(PERSON)


def served(tiny, params_list, ends=True):
    """Run ``params_list`` together on a scheduler; (text, finish reason, request) of each."""
    model, tokenizer = tiny
    scheduler = BatchScheduler(model, tokenizer, max_batch=4).start()
    try:
        prompt = [int(t) for t in tokenizer("Answer in JSON: the capital of France")["input_ids"]]
        eos = [tokenizer.eos_token_id] if ends else []
        requests = [scheduler.submit(Request(prompt, params, lambda update: None, eos)) for params in params_list]
        wait_for(lambda: all(r.finished for r in requests))
    finally:
        scheduler.close()
    return [(tokenizer.decode(r.generated, skip_special_tokens=True), r.finish_reason, r) for r in requests]


def test_json_mode_writes_a_json_object_beside_a_plain_row_that_goes_on_as_alone(tiny):
    model, tokenizer = tiny
    closing = tokenizer.convert_tokens_to_ids("}")
    blanks = tuple((t, -100.0) for t in blank_tokens(tokenizer))
    plain = SamplingParams(max_tokens=24, temperature=0)
    params = [SamplingParams(max_tokens=90, temperature=0, json_mode=True, logit_bias=blanks),
              SamplingParams(max_tokens=90, temperature=0.8, seed=3, json_mode=True, logit_bias=blanks),
              SamplingParams(max_tokens=24, temperature=0, json_mode=True, logit_bias=((closing, 100.0),)), plain]
    out = served(tiny, params)
    vocabulary = GrammarVocabulary.of(tokenizer, model.config.vocab_size)
    for text, reason, request in out[:3]:  # (a random model's keys run on: a beginning of an object at least)
        check = TokenConstraint(vocabulary, any_object_grammar(), [tokenizer.eos_token_id])
        for token in request.generated:
            check.advance(token)  # (raises on a token the grammar refuses)
        assert text.startswith("{") and (reason == "length" or isinstance(json.loads(text), dict)), text
    assert out[2][:2] == ("{}", "stop") and out[2][2].generated[-1] == tokenizer.eos_token_id
    alone = served(tiny, [plain])[0]
    assert out[3][0] == alone[0] and out[3][2].generated == alone[2].generated
    with pytest.raises(json.JSONDecodeError):  # the random model's own text is no JSON
        json.loads(out[3][0])


def test_schema_outputs_validate_greedy_and_seeded_and_end_without_an_end_token(tiny):
    """Outputs of a schema (nested object, enum, bounded array and integer, pattern, required) parse and validate;
    a seeded one repeats; a request with no end token ends where the grammar is complete."""
    tokenizer = tiny[1]
    blanks = tuple((t, -100.0) for t in blank_tokens(tokenizer))
    grammar = json_schema_grammar(PERSON)
    params = [SamplingParams(max_tokens=100, temperature=0, grammar=grammar, logit_bias=blanks),
              SamplingParams(max_tokens=100, temperature=1.0, seed=5, grammar=grammar, logit_bias=blanks),
              SamplingParams(max_tokens=100, temperature=1.0, seed=5, grammar=grammar, logit_bias=blanks)]
    out = served(tiny, params)
    for text, reason, _ in out:
        assert reason == "stop", text
        assert schema_errors(json.loads(text), PERSON) == [], text
    assert out[1][0] == out[2][0] and out[0][0] != out[1][0]
    text, reason, request = served(tiny, params[:1], ends=False)[0]
    assert reason == "stop" and text == out[0][0] and tokenizer.eos_token_id not in request.generated


def test_generate_keeps_to_a_schema_through_a_logits_processor(tiny):
    """GrammarLogitsProcessor for generate: greedy, sampled and beam-searched rows each valid, and reused for a
    second call."""
    model, tokenizer = tiny
    ids = tokenizer(["Answer in JSON:", "the capital of France"], padding=True, padding_side="left",
                    return_tensors="np")
    bias = np.zeros(len(tokenizer), np.float32)
    bias[blank_tokens(tokenizer)] = -100.0
    processors = [lambda _, scores: scores + bias, GrammarLogitsProcessor.from_json_schema(PERSON, tokenizer)]
    runs = [dict(), dict(do_sample=True, top_k=0, seed=2), dict(num_beams=2)]
    for run in runs:
        out = model.generate(ids["input_ids"], attention_mask=ids["attention_mask"], max_new_tokens=100,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                             logits_processor=processors, **run)
        for row in out[:, ids["input_ids"].shape[1]:]:
            text = tokenizer.decode(row, skip_special_tokens=True)
            assert schema_errors(json.loads(text), PERSON) == [], (run, text)


def test_a_logits_processor_grammar_follows_assisted_generation(tiny):
    """Assisted generation asks the processors at every position of a draft and, after a rejected draft token,
    again at an earlier length (and prompt lookup asks them of the draft's prefixes): each call finds the grammar's
    state of its own tokens, so greedy outputs are the unassisted ones and sampled ones stay valid."""
    model, tokenizer = tiny
    ids = tokenizer(["Answer in JSON: the capital of France"], return_tensors="np")["input_ids"]
    bias = np.zeros(len(tokenizer), np.float32)
    bias[blank_tokens(tokenizer)] = -100.0

    def run(**options):
        processors = [lambda _, scores: scores + bias, GrammarLogitsProcessor.from_json_schema(PERSON, tokenizer)]
        out = model.generate(ids, max_new_tokens=100, eos_token_id=tokenizer.eos_token_id,
                             logits_processor=processors, **options)
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert schema_errors(json.loads(text), PERSON) == [], (options, text)
        return out
    plain = run()
    assistant = AutoModelForCausalLM.from_pretrained(MODEL.parent / "assisted" / "assistant", requires_grad=False)
    for assisted in (dict(prompt_lookup_num_tokens=3), dict(assistant_model=assistant, num_assistant_tokens=3)):
        assert run(**assisted).tolist() == plain.tolist()
        stats = model.assisted_stats
        assert stats.drafted > stats.accepted > 0  # drafts kept and rejected
        run(do_sample=True, seed=1, top_k=0, **assisted)
