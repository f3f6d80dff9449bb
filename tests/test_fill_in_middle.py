"""Fill-in-the-middle (FIM) prompts (models/fill_in_middle.py) and the ``suffix`` of ``vkformers serve``'s
/v1/completions, as editors' code completion sends it.

Each family's prompt is checked against the layout its model documents, as token ids written out here: StarCoder's,
SantaCoder's, Qwen2.5-Coder's, CodeGemma's and DeepSeek-Coder's ``PRE prefix SUF suffix MID`` (the last two after
BOS), CodeLlama's ``<PRE> {prefix} <SUF>{suffix} <MID>`` (Meta's reference: the prefix with SentencePiece's leading
space, the suffix without it) and Mistral's suffix-first ``<s>[SUFFIX]suffix[PREFIX] prefix`` (mistral-common's
encode_fim). The FIM tokens a GGUF's metadata names are found by id whatever their spelling. End to end, a tiny
random GGUF llama whose vocabulary has Qwen's FIM tokens answers the openai client's completions with a suffix as
model.generate answers the FIM prompt's ids (greedy), whole and streamed; a FIM end token ends the choice ("stop",
not in the text); a model without FIM tokens answers 400.
"""
from __future__ import annotations

import pytest
from test_gguf import random_llama, train_bpe, write_tiny_gguf
from test_serve import (SERVED, error_of, openai, reference_tokens, request, serving, serving_tiny,  # noqa: F401
                        web, write_tiny_model)  # (web: a fixture)
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

import vkformers as vkf
from vkformers.cli import serve as cli_serve
from vkformers.models.fill_in_middle import FillInMiddleError, fill_in_middle_prompt, fill_in_middle_tokens
from vkformers.models.gguf import load_gguf_model, load_gguf_tokenizer
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.models.tokenizer import PreTrainedTokenizer

PREFIX, SUFFIX = "def f(", "\n    return x"
WORDS = ["def", "f", "(", "return", "x"]  # ids len(specials) + 0..4 in word_level's vocabularies


def word_level(specials, **config):
    """A vocabulary of ``specials`` (ids 0, 1, ...) then WORDS, split at whitespace: no space is ever added."""
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate([*specials, *WORDS])}, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return PreTrainedTokenizer(backend, config)


# Llama's SentencePiece layout in tokenizer.json (CodeLlama's, Mistral v3's): "▁" before the text, spaces as "▁",
# BPE over the whole text with bytes for what the vocabulary lacks ("\n", "☺")
SP_MERGES = [("▁", "d"), ("▁d", "e"), ("▁de", "f"), ("▁", "f"), ("▁", "x"), ("r", "e"), ("re", "t"), ("ret", "u"),
             ("retu", "r"), ("retur", "n"), ("▁", "return")]
SP_PIECES = ["<unk>", "<s>", "</s>", "<0x0A>", "<0xE2>", "<0x98>", "<0xBA>", "▁", "d", "e", "f", "(", "r", "t", "u",
             "n", "x"] + ["".join(m) for m in SP_MERGES]


def sentencepiece_like(specials):
    vocab = {piece: index for index, piece in enumerate(SP_PIECES)}
    backend = Tokenizer(models.BPE(vocab, SP_MERGES, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ["<s>", "</s>", *specials]])
    return PreTrainedTokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                         "add_bos_token": True})


QWEN = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
        "<|file_sep|>"]  # Qwen2.5-Coder's order (151643, then 151659...)


@pytest.mark.parametrize("specials, config, expected, documented, ends", [
    # Qwen2.5-Coder's card: <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>, no BOS
    (QWEN, {"eos_token": "<|endoftext|>"}, [1, 7, 8, 9, 3, 10, 11, 2],
     "<|fim_prefix|>def f(<|fim_suffix|>\n    return x<|fim_middle|>", {0, 1, 2, 3, 4, 5, 6}),
    # StarCoder / StarCoder2: <fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>
    (["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"], {},
     [1, 5, 6, 7, 3, 8, 9, 2], "<fim_prefix>def f(<fim_suffix>\n    return x<fim_middle>", {0, 1, 2, 3, 4}),
    # SantaCoder's hyphens
    (["<|endoftext|>", "<fim-prefix>", "<fim-middle>", "<fim-suffix>", "<fim-pad>"], {},
     [1, 5, 6, 7, 3, 8, 9, 2], "<fim-prefix>def f(<fim-suffix>\n    return x<fim-middle>", {0, 1, 2, 3, 4}),
    # CodeGemma: <bos><|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>, ending at <|file_separator|>
    (["<pad>", "<eos>", "<bos>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|file_separator|>"],
     {"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True}, [2, 3, 7, 8, 9, 5, 10, 11, 4],
     "<|fim_prefix|>def f(<|fim_suffix|>\n    return x<|fim_middle|>", {3, 4, 5, 6}),
    # DeepSeek-Coder's README: <｜fim▁begin｜>{prefix}<｜fim▁hole｜>{suffix}<｜fim▁end｜> after its BOS
    (["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜fim▁hole｜>", "<｜fim▁begin｜>", "<｜fim▁end｜>"],
     {"bos_token": "<｜begin▁of▁sentence｜>", "add_bos_token": True}, [0, 3, 5, 6, 7, 2, 8, 9, 4],
     "<｜fim▁begin｜>def f(<｜fim▁hole｜>\n    return x<｜fim▁end｜>", {2, 3, 4}),
])
def test_each_family_lays_out_its_documented_prompt(specials, config, expected, documented, ends):
    tokenizer = word_level(specials, **config)
    ids = fill_in_middle_prompt(tokenizer, PREFIX, SUFFIX)
    assert ids == expected
    assert ids == tokenizer(documented)["input_ids"]  # the documented text, its FIM tokens parsed as the model's
    assert set(fill_in_middle_tokens(tokenizer).end) == ends
    bos, (pre, suf, mid), x = expected[:-8], (expected[-8], expected[-4], expected[-1]), len(specials) + 4
    assert fill_in_middle_prompt(tokenizer, "", "x") == bos + [pre, suf, x, mid]  # an empty prefix: no tokens


def test_codellama_spaces_the_prefix_and_not_the_suffix():
    """Meta's infilling_prompt_tokens: [BOS, <PRE>] + encode(prefix) + [<SUF>] + encode_infilling(suffix) + [<MID>],
    the string "<PRE> {prefix} <SUF>{suffix} <MID>" whose ▁<SUF> and ▁<MID> hold the spaces before them."""
    tokenizer = sentencepiece_like(["▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"])
    assert tokenizer.tokenize(SUFFIX) == ["▁", "<0x0A>", "▁", "▁", "▁", "▁return", "▁x"]  # with the space
    tokens = tokenizer.convert_ids_to_tokens(fill_in_middle_prompt(tokenizer, PREFIX, SUFFIX))
    assert tokens == ["<s>", "▁<PRE>", "▁def", "▁f", "(", "▁<SUF>", "<0x0A>", "▁", "▁", "▁", "▁return", "▁x", "▁<MID>"]
    tokens = tokenizer.convert_ids_to_tokens(fill_in_middle_prompt(tokenizer, "", " return x"))
    assert tokens == ["<s>", "▁<PRE>", "▁<SUF>", "▁return", "▁x", "▁<MID>"]
    fim = fill_in_middle_tokens(tokenizer)
    assert fim.family == "CodeLlama" and set(tokenizer.convert_ids_to_tokens(list(fim.end))) == {
        "▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"}


def test_mistral_puts_the_suffix_first_and_ends_with_the_prefix():
    """mistral-common's encode_fim: [BOS, [SUFFIX]] + the suffix without the leading space + [[PREFIX]] + the
    prefix encoded as a text: "<s>[SUFFIX]suffix[PREFIX] prefix", no middle token."""
    tokenizer = sentencepiece_like(["[PREFIX]", "[SUFFIX]"])
    fim = fill_in_middle_tokens(tokenizer)
    assert (fim.family, fim.middle, fim.suffix_first) == ("Mistral", None, True)
    tokens = tokenizer.convert_ids_to_tokens(fill_in_middle_prompt(tokenizer, PREFIX, SUFFIX))
    assert tokens == ["<s>", "[SUFFIX]", "<0x0A>", "▁", "▁", "▁", "▁return", "▁x", "[PREFIX]", "▁def", "▁f", "("]


def test_a_tokenizer_without_fim_tokens_is_refused():
    tokenizer = word_level(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert fill_in_middle_tokens(tokenizer) is None
    with pytest.raises(FillInMiddleError, match="this model has no fill-in-the-middle tokens: .*<fim_prefix>"):
        fill_in_middle_prompt(tokenizer, PREFIX, SUFFIX)
    with pytest.raises(FillInMiddleError, match="as strings"):
        fill_in_middle_prompt(word_level(QWEN), PREFIX, [1, 2])


def tiny_gguf(path, specials, metadata=None):
    """A tiny random GGUF llama whose byte-level vocabulary has ``specials`` as control tokens; (path, tokenizer)."""
    backend = train_bpe(specials)
    vocab = backend.get_vocab()
    keys = {f"tokenizer.ggml.{key}": vocab.get(token, token) for key, token in (metadata or {}).items()}
    path = write_tiny_gguf(path, random_llama(backend.get_vocab_size()), backend, control=specials, metadata=keys)
    return path, load_gguf_tokenizer(path)


def test_a_gguf_names_its_fim_tokens_by_id_whatever_their_spelling(tmp_path):
    spelled = ["<a>", "<b>", "<c>", "<d>", "<e>"]
    _, tokenizer = tiny_gguf(tmp_path / "named.gguf", spelled, {
        "fim_pre_token_id": "<b>", "fim_suf_token_id": "<c>", "fim_mid_token_id": "<a>", "fim_pad_token_id": "<d>",
        "fim_rep_token_id": -1})  # (-1: llama.cpp's none)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in spelled}
    assert tokenizer.fim_token_ids == {"prefix": ids["<b>"], "suffix": ids["<c>"], "middle": ids["<a>"],
                                       "pad": ids["<d>"]}
    fim = fill_in_middle_tokens(tokenizer)
    assert (fim.family, fim.prefix, fim.suffix, fim.middle) == ("GGUF metadata", ids["<b>"], ids["<c>"], ids["<a>"])
    assert set(fim.end) == {ids["<a>"], ids["<b>"], ids["<c>"], ids["<d>"]}
    text = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in (PREFIX, SUFFIX)]
    assert fill_in_middle_prompt(tokenizer, PREFIX, SUFFIX) == [ids["<b>"], *text[0], ids["<c>"], *text[1],
                                                                ids["<a>"]]
    # llama.cpp's older keys, which it still reads
    _, older = tiny_gguf(tmp_path / "older.gguf", spelled, {
        "prefix_token_id": "<e>", "suffix_token_id": "<d>", "middle_token_id": "<c>"})
    ids = {t: older.convert_tokens_to_ids(t) for t in spelled}
    fim = fill_in_middle_tokens(older)
    assert (fim.prefix, fim.suffix, fim.middle) == (ids["<e>"], ids["<d>"], ids["<c>"])
    # none named, none spelled
    _, plain = tiny_gguf(tmp_path / "plain.gguf", spelled)
    assert plain.fim_token_ids == {} and fill_in_middle_tokens(plain) is None


# ---------------------------------------------------------------- served

@pytest.fixture(scope="module")
def coder(tmp_path_factory):
    """A tiny random GGUF llama whose vocabulary has Qwen's FIM tokens: (path, tokenizer, reference model)."""
    path, tokenizer = tiny_gguf(tmp_path_factory.mktemp("fim") / "coder.gguf", QWEN)
    return path, tokenizer, load_gguf_model(AutoModelForCausalLM, path, requires_grad=False)


@pytest.fixture(scope="module")
def coder_server(coder, web):  # noqa: F811 (the fixture)
    with serving_tiny(coder) as served:
        yield served


def test_a_completion_with_a_suffix_generates_the_middle_as_generate_does(coder_server, coder):
    _, tokenizer, reference = coder
    client, fim = coder_server["client"], fill_in_middle_tokens(tokenizer)
    ends = cli_serve.eos_ids(reference, tokenizer) + list(fim.end)
    choices = []
    for prefix, suffix in ((PREFIX, SUFFIX), ("hello wor", " tokens"), ("", "paris")):
        ids = fill_in_middle_prompt(tokenizer, prefix, suffix)
        assert ids[0] == tokenizer.convert_tokens_to_ids("<|fim_prefix|>") and ids[-1] == fim.middle
        tokens = reference_tokens(reference, ids, 8, ends).tolist()
        response = client.completions.create(model=SERVED, prompt=prefix, suffix=suffix, max_tokens=8,
                                             temperature=0, logprobs=2)
        choice = response.choices[0]
        assert choice.text == tokenizer.decode(tokens, skip_special_tokens=True)
        assert choice.finish_reason == ("stop" if tokens[-1] in ends else "length")
        assert len(choice.logprobs.token_logprobs) == len(tokens)
        assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(ids), len(tokens))
        choices.append((prefix, suffix, choice.text, len(ids)))
    # streamed: the same text, the usage of the built prompt
    chunks = list(client.completions.create(model=SERVED, prompt=PREFIX, suffix=SUFFIX, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choices[0][2]
    assert chunks[-1].usage.prompt_tokens == choices[0][3]
    # a batch of prompts: each one's middle before the one suffix
    batch = client.completions.create(model=SERVED, prompt=[PREFIX, "hello wor"], suffix=SUFFIX, max_tokens=8,
                                      temperature=0)
    again = client.completions.create(model=SERVED, prompt="hello wor", suffix=SUFFIX, max_tokens=8, temperature=0)
    assert [c.text for c in batch.choices] == [choices[0][2], again.choices[0].text]


def test_a_fim_end_token_ends_the_middle_and_is_not_in_the_text(coder_server, coder):
    tokenizer, client = coder[1], coder_server["client"]
    for token in ("<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|endoftext|>", "<|fim_prefix|>"):
        bias = {str(tokenizer.convert_tokens_to_ids(token)): 100}  # the token comes first
        response = client.completions.create(model=SERVED, prompt=PREFIX, suffix=SUFFIX, max_tokens=4,
                                             temperature=0, logit_bias=bias)
        assert (response.choices[0].text, response.choices[0].finish_reason) == ("", "stop"), token
        assert response.usage.completion_tokens == 1
    # a plain completion does not end there: the FIM tokens end a middle only
    response = client.completions.create(model=SERVED, prompt=PREFIX, max_tokens=3, temperature=0,
                                         logit_bias={str(tokenizer.convert_tokens_to_ids("<|fim_pad|>")): 100})
    assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens == 3


def test_suffix_requests_the_server_refuses(coder_server, coder):
    route, body = "/v1/completions", {"model": SERVED, "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 2}
    status, error = error_of(request(coder_server, "POST", route, {**body, "prompt": [5, 6, 7]}))
    assert status == 400 and error["param"] == "prompt" and "token ids" in error["message"]
    status, error = error_of(request(coder_server, "POST", route, {**body, "echo": True}))
    assert status == 400 and error["param"] == "echo"
    status, error = error_of(request(coder_server, "POST", route, {**body, "suffix": 3}))
    assert status == 400 and error["param"] == "suffix"
    # an empty suffix is a plain completion, as without one
    client = coder_server["client"]
    plain = client.completions.create(model=SERVED, prompt=PREFIX, max_tokens=4, temperature=0)
    empty = client.completions.create(model=SERVED, prompt=PREFIX, suffix="", max_tokens=4, temperature=0)
    assert empty.choices[0].text == plain.choices[0].text
    assert empty.usage.prompt_tokens == plain.usage.prompt_tokens == len(coder[1](PREFIX)["input_ids"])


def test_a_model_without_fim_tokens_answers_400(tmp_path, web):  # noqa: F811 (the fixture)
    with serving_tiny(write_tiny_model(tmp_path)) as served:
        with pytest.raises(openai.BadRequestError, match="this model has no fill-in-the-middle tokens"):
            served["client"].completions.create(model=SERVED, prompt=PREFIX, suffix=SUFFIX, max_tokens=4)
        status, error = error_of(request(served, "POST", "/v1/completions", {"prompt": PREFIX, "suffix": SUFFIX}))
        assert status == 400 and error["param"] == "suffix" and "\n" not in error["message"]
        assert error["message"].startswith("this model has no fill-in-the-middle tokens: ")


def test_the_python_helper_is_public():
    assert vkf.fill_in_middle_prompt is fill_in_middle_prompt and vkf.fill_in_middle_tokens is fill_in_middle_tokens
    assert vkf.fill_in_middle_prompt(word_level(QWEN), PREFIX, SUFFIX) == [1, 7, 8, 9, 3, 10, 11, 2]
