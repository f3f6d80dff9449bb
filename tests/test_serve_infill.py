"""llama.cpp's ``POST /infill`` on ``vkformers serve`` (cli/infill_route.py), as llama.vscode and llama.vim call it.

The prompt is checked against llama.cpp's documented layout, written out here as token ids: with the vocabulary's
repository and file-separator tokens (Qwen2.5-Coder's repo-level pattern)
``<|repo_name|>myproject\\n<|file_sep|>{filename}\\n{text}...<|file_sep|>filename\\n<|fim_prefix|>{prefix}{prompt}
<|fim_suffix|>{suffix}<|fim_middle|>``, without them each chunk after a "--- snippet ---" line, and cut to fit as
llama.cpp cuts it (the prefix's last 3/4 of the batch, the suffix's first 1/4, the extra context's last tokens).
End to end, the tiny random GGUF llama with Qwen's FIM tokens answers /infill (raw HTTP, whole and streamed) with
model.generate's greedy middle of those ids, in llama.cpp's response and stream format, and llama.cpp's errors.
"""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from test_fill_in_middle import QWEN, coder, coder_server, tiny_gguf  # noqa: F401 (fixtures)
from test_serve import API_KEY, reference_tokens, request, serving_tiny, web, write_tiny_model  # noqa: F401
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from vkformers.cli import serve as cli_serve
from vkformers.cli.api_schema import ApiError
from vkformers.cli.infill_route import InfillRoute, Middle, picked_fields, read_infill
from vkformers.models.batching import Update
from vkformers.models.fill_in_middle import fill_in_middle_prompt, fill_in_middle_tokens, infill_prompt
from vkformers.models.tokenizer import PreTrainedTokenizer

WORDS = ["def", "f", "(", "return", "x", "=", "1", "y", "myproject", "filename", "tmp", "a", ".", "py", "---",
         "snippet", "z"]


def words(specials, **config):
    """A vocabulary of ``specials`` (ids 0, 1, ...) then WORDS (split at whitespace and punctuation, no space ever
    added): each text's ids read off by eye."""
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate([*specials, *WORDS])}, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return PreTrainedTokenizer(backend, config)


def ids_of(tokenizer, *pieces):
    return [tokenizer.convert_tokens_to_ids(p) for p in pieces]


def test_the_repo_level_pattern_with_repository_and_file_separator_tokens():
    tokenizer = words(QWEN, eos_token="<|endoftext|>")
    fim = fill_in_middle_tokens(tokenizer)
    assert [fim.repository, fim.file_separator] == ids_of(tokenizer, "<|repo_name|>", "<|file_sep|>")
    extra = [("a.py", "x = 1\n"), (None, "y\n")]
    expected = ids_of(tokenizer, "<|repo_name|>", "myproject", "<|file_sep|>", "a", ".", "py", "x", "=", "1",
                      "<|file_sep|>", "tmp", "y", "<|file_sep|>", "filename",
                      "<|fim_prefix|>", "def", "f", "(", "x", "<|fim_suffix|>", "return", "x", "<|fim_middle|>")
    assert infill_prompt(tokenizer, "def f(", "return x", extra, "x") == expected
    # llama.cpp's README's text of it, its special tokens parsed as the model's
    documented = ("<|repo_name|>myproject\n<|file_sep|>a.py\nx = 1\n<|file_sep|>tmp\ny\n<|file_sep|>filename\n"
                  "<|fim_prefix|>def f(x<|fim_suffix|>return x<|fim_middle|>")
    assert expected == tokenizer(documented)["input_ids"]
    # with no chunks the repository's and the current file's names stay, as llama.cpp writes them
    assert infill_prompt(tokenizer, "def f(", "return x") == \
        expected[:2] + expected[12:18] + expected[19:]
    assert fill_in_middle_prompt(tokenizer, "def f(", "return x") == expected[14:18] + expected[19:]


def test_without_a_file_separator_each_chunk_follows_a_snippet_line():
    # StarCoder's spellings: llama.cpp takes <reponame> as the repository token and has no file separator for it
    tokenizer = words(["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<reponame>",
                       "<file_sep>"])
    fim = fill_in_middle_tokens(tokenizer)
    assert (fim.repository, fim.file_separator) == (tokenizer.convert_tokens_to_ids("<reponame>"), None)
    assert infill_prompt(tokenizer, "def f(", "x", [("a.py", "x = 1"), ("b.py", "y")]) == ids_of(
        tokenizer, "<reponame>", "myproject", "---", "snippet", "---", "x", "=", "1", "---", "snippet", "---", "y",
        "<fim_prefix>", "def", "f", "(", "<fim_suffix>", "x", "<fim_middle>")
    # CodeGemma's: neither token; BOS starts the prompt, before the extra context
    gemma = words(["<pad>", "<eos>", "<bos>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                   "<|file_separator|>"], bos_token="<bos>", eos_token="<eos>", add_bos_token=True)
    fim = fill_in_middle_tokens(gemma)
    assert (fim.repository, fim.file_separator) == (None, None)
    assert infill_prompt(gemma, "f", "x", [("a.py", "z")]) == ids_of(
        gemma, "<bos>", "---", "snippet", "---", "z", "<|fim_prefix|>", "f", "<|fim_suffix|>", "x", "<|fim_middle|>")


def test_the_prompt_is_cut_to_fit_as_llama_cpp_cuts_it():
    """batch 16: the prefix keeps its last 12 tokens, the suffix its first 16 // 4 - 2 - len(prompt); context 40,
    reserve 4: the extra context its last 40 - 16 - 8 = 16 tokens."""
    tokenizer = words(QWEN)
    prefix = " ".join(["x"] * 10 + ["def", "f", "(", "y", "z"])  # 15 tokens
    suffix = "return x y z"
    extra = [("a.py", " ".join(["1"] * 20))]
    tok = {t: tokenizer.convert_tokens_to_ids(t) for t in [*QWEN, *WORDS]}
    header = [tok["<|repo_name|>"], tok["myproject"], tok["<|file_sep|>"], tok["a"], tok["."], tok["py"]]
    files = header + [tok["1"]] * 20 + [tok["<|file_sep|>"], tok["filename"]]  # 28 tokens
    prefix_ids = [tok["x"]] * 10 + [tok[t] for t in ("def", "f", "(", "y", "z")]
    cut = infill_prompt(tokenizer, prefix, suffix, extra, "", batch=16, context=40, reserve=4)
    assert cut == files[-16:] + [tok["<|fim_prefix|>"], *prefix_ids[-12:], tok["<|fim_suffix|>"], tok["return"],
                                 tok["x"], tok["<|fim_middle|>"]]
    # the typed prompt takes its room from the suffix
    cut = infill_prompt(tokenizer, prefix, suffix, extra, "y", batch=16, context=40, reserve=4)
    assert cut[-4:] == [tok["y"], tok["<|fim_suffix|>"], tok["return"], tok["<|fim_middle|>"]]
    # no room for the extra context: none of it
    assert infill_prompt(tokenizer, "f", "x", extra, batch=16, context=20, reserve=4)[0] == tok["<|fim_prefix|>"]


def test_a_gguf_names_its_repository_and_separator_tokens(tmp_path):
    spelled = ["<a>", "<b>", "<c>", "<d>", "<e>"]
    _, tokenizer = tiny_gguf(tmp_path / "named.gguf", spelled, {
        "fim_pre_token_id": "<a>", "fim_suf_token_id": "<b>", "fim_mid_token_id": "<c>", "fim_rep_token_id": "<d>",
        "fim_sep_token_id": "<e>"})
    fim = fill_in_middle_tokens(tokenizer)
    assert [fim.repository, fim.file_separator] == ids_of(tokenizer, "<d>", "<e>")


def test_llama_cpp_s_sampling_fields_and_defaults():
    tokenizer = words(QWEN)
    fim = fill_in_middle_tokens(tokenizer)
    base = {"input_prefix": "def f(", "input_suffix": "return x"}
    asked = read_infill(base, tokenizer, fim, 96)
    length = len(asked.prompt)
    p = asked.params
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.seed) == (0.8, 40, 0.95, 0.05, None)
    assert (p.max_tokens, asked.predict, asked.to_context, asked.warm) == (96 - length, -1, True, False)
    # llama.vscode's and llama.vim's: samplers top_k, top_p and infill (not implemented here): no temperature, no min_p
    asked = read_infill({**base, "n_predict": 8, "top_k": 40, "top_p": 0.99, "samplers": ["top_k", "top_p", "infill"],
                         "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000, "n_indent": 4,
                         "response_fields": ["content"], "seed": 4294967295}, tokenizer, fim, 96)
    p = asked.params
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.seed, p.max_tokens) == (1.0, 40, 0.99, 0.0, None, 8)
    assert (asked.n_indent, asked.fields, asked.to_context) == (4, ["content"], False)
    assert asked.settings["samplers"] == ["top_k", "top_p"]
    p = read_infill({**base, "samplers": "kt", "temperature": 0.5, "seed": 7}, tokenizer, fim, 96).params
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.seed) == (0.5, 40, 1.0, 0.0, 7)
    p = read_infill({**base, "temperature": -1, "max_tokens": 3, "stop": ["\n", ""]}, tokenizer, fim, 96).params
    assert (p.temperature, p.max_tokens, p.stop) == (0.0, 3, ("\n",))
    # more than the context holds: the extra context (twice n_predict kept free) goes, and the output runs to its end
    asked = read_infill({**base, "n_predict": 1000}, tokenizer, fim, 96)
    assert asked.prompt == fill_in_middle_prompt(tokenizer, "def f(", "return x")
    assert (asked.params.max_tokens, asked.to_context) == (96 - len(asked.prompt), True)
    asked = read_infill({**base, "n_predict": 0}, tokenizer, fim, 96)
    assert (asked.params.max_tokens, asked.warm) == (1, True)  # one token run and not shown: the prompt prefilled
    for field, value in (("repeat_penalty", 1.1), ("lora", [{"id": 0, "scale": 0.5}]), ("n_probs", 3),
                         ("logit_bias", [[1, 2.0]]), ("seed", -2), ("samplers", 3), ("stop", [1]),
                         ("input_extra", {"text": "x"}), ("input_extra", [{"filename": "a"}]), ("prompt", [1]),
                         ("input_prefix", None)):
        with pytest.raises(ApiError) as caught:
            read_infill({**base, field: value}, tokenizer, fim, 96)
        assert caught.value.status == 400 and caught.value.param == field
    assert read_infill({**base, "repeat_penalty": 1.0, "logit_bias": {}, "lora": []}, tokenizer, fim, 96)


def test_the_output_ends_at_a_stop_word_or_a_line_indented_less_than_n_indent():
    middle = Middle(("END",), 0)
    # (the scheduler holds back text that may begin a stop word, and keeps the word that ends the output)
    assert [middle.feed(p) for p in ("ab", "c", "END")] == ["ab", "c", ""]
    assert (middle.text, middle.stop_type, middle.stopping_word, middle.cut) == ("abc", "word", "END", True)
    assert middle.feed("more") == ""
    # llama.cpp's n_indent: the first line is free; a later one indented less ends the output before its first
    # character, its indentation kept; an empty line is indented by 0
    middle = Middle((), 4)
    assert [middle.feed(p) for p in ("x = 1\n", "    y", " = 2\n  ", "  z\n", "  w")] == \
        ["x = 1\n", "    y", " = 2\n  ", "  z\n", "  "]
    assert (middle.text, middle.stop_type, middle.cut) == ("x = 1\n    y = 2\n    z\n  ", "limit", True)
    middle = Middle((), 2)
    assert middle.feed("a\n\n  b") == "a\n" and middle.stop_type == "limit"
    middle = Middle((), 2)
    assert middle.feed("a\n\t\tb\n  c") == "a\n\t\tb\n  c" and not middle.cut


class Job:
    cancelled = False

    def cancel(self):
        self.cancelled = True


def pieces_of(updates, warm=False, stops=(), n_indent=0):
    """InfillRoute._pieces over ``updates`` queued at once: (the kept pieces, the Middle, the job)."""
    route = InfillRoute(None, None, "tiny", None, body=None, submit=None, failed=lambda: ApiError(500, "failed"))

    async def run():
        queue = asyncio.Queue()
        for update in updates:
            queue.put_nowait((0, update))
        middle, job = Middle(stops, n_indent), Job()
        pieces = [text async for text, _ in route._pieces(job, queue, SimpleNamespace(warm=warm), middle)]
        return pieces, middle, job
    return asyncio.run(run())


def test_the_stop_type_says_what_ended_the_output():
    pieces, middle, job = pieces_of([Update("ab", [], None, 1), Update("c", [], "stop", 2)])
    assert (pieces, middle.text, middle.stop_type, middle.tokens, job.cancelled) == (["ab", "c"], "abc", "eos", 2,
                                                                                     False)
    pieces, middle, _ = pieces_of([Update("ab", [], None, 1), Update("c", [], "length", 2)])
    assert (middle.stop_type, middle.tokens) == ("limit", 2)
    pieces, middle, _ = pieces_of([Update("ab", [], None, 1), Update("cEND", [], "stop", 2)], stops=("END",))
    assert (pieces, middle.stop_type, middle.stopping_word) == (["ab", "c"], "word", "END")
    # a line indented less: the output ends there and the request leaves the batch, its later updates unread
    pieces, middle, job = pieces_of([Update("a\n", [], None, 1), Update("b", [], None, 2), Update("c", [], None, 3)],
                                    n_indent=2)
    assert (pieces, middle.stop_type, middle.tokens, job.cancelled) == (["a\n", ""], "limit", 2, True)
    # n_predict 0: the token run is not shown
    pieces, middle, _ = pieces_of([Update("zz", [], "length", 1)], warm=True)
    assert (pieces, middle.stop_type, middle.tokens) == ([""], "limit", 0)
    with pytest.raises(ApiError, match="failed"):
        pieces_of([Update("", [], "error", 0)])


def test_response_fields_pick_nested_values_by_path():
    answer = {"content": "x", "timings": {"prompt_n": 3}, "truncated": False}
    assert picked_fields(answer, ["content", "timings/prompt_n", "timings/nothing", ""]) == {
        "content": "x", "timings/prompt_n": 3}
    assert picked_fields(answer, None) is answer and picked_fields(answer, []) is answer


# ---------------------------------------------------------------- served

CODE = {"input_prefix": "def f(", "input_suffix": " tokens", "prompt": "x",
        "input_extra": [{"filename": "a.py", "text": "x = 1\n", "time": 12}]}


def expected_prompt(tokenizer, prefix, suffix, extra, typed):
    """The repo-level pattern's ids, written out (small enough that nothing is cut at max_model_len 96)."""
    def text(t):
        return tokenizer(t, add_special_tokens=False)["input_ids"]

    def token(t):
        return [tokenizer.convert_tokens_to_ids(t)]
    ids = token("<|repo_name|>") + text("myproject\n")
    for chunk in extra:
        ids += token("<|file_sep|>") + text(chunk["filename"] + "\n") + text(chunk["text"])
    ids += token("<|file_sep|>") + text("filename\n")
    return ids + token("<|fim_prefix|>") + text(prefix) + text(typed) + token("<|fim_suffix|>") + text(suffix) + \
        token("<|fim_middle|>")


def events(text):
    """A llama.cpp stream's events: ``data: {json}`` blocks, nothing else."""
    blocks = text.split("\n\n")
    assert blocks[-1] == "" and all(b.startswith("data: ") for b in blocks[:-1]), text
    return [json.loads(b[len("data: "):]) for b in blocks[:-1]]


def test_infill_generates_the_middle_as_generate_does_whole_and_streamed(coder_server, coder):  # noqa: F811
    _, tokenizer, reference = coder
    fim = fill_in_middle_tokens(tokenizer)
    ends = cli_serve.eos_ids(reference, tokenizer) + list(fim.end)
    ids = expected_prompt(tokenizer, CODE["input_prefix"], CODE["input_suffix"], CODE["input_extra"], "x")
    # (nothing cut at 96 positions, n_predict 8: the extra context's 32 tokens fit 96 - 48 - 2 x 8)
    tokens = reference_tokens(reference, ids, 8, ends).tolist()
    body = {**CODE, "n_predict": 8, "temperature": 0, "cache_prompt": True, "t_max_prompt_ms": 500,
            "t_max_predict_ms": 250, "samplers": ["top_k", "top_p", "temperature"]}
    status, text = request(coder_server, "POST", "/infill", body)
    assert status == 200, text
    answer = json.loads(text)
    content = tokenizer.decode(tokens, skip_special_tokens=True)
    stop_type = "eos" if tokens[-1] in ends else "limit"
    assert (answer["content"], answer["stop"], answer["stop_type"], answer["stopping_word"]) == \
        (content, True, stop_type, "")
    assert (answer["tokens_predicted"], answer["tokens_evaluated"], answer["tokens_cached"]) == \
        (len(tokens), len(ids), len(ids) + len(tokens))
    assert answer["prompt"] == tokenizer.decode(ids, skip_special_tokens=False)
    assert answer["prompt"].startswith("<|repo_name|>myproject\n<|file_sep|>a.py\nx = 1\n<|file_sep|>filename\n"
                                       "<|fim_prefix|>def f(x<|fim_suffix|> tokens<|fim_middle|>")
    assert (answer["truncated"], answer["has_new_line"], answer["model"]) == (False, "\n" in content, "tiny")
    timings = answer["timings"]
    assert (timings["prompt_n"], timings["predicted_n"]) == (len(ids), len(tokens))
    assert timings["prompt_ms"] > 0 and timings["predicted_ms"] >= 0 and timings["predicted_per_second"] >= 0
    assert answer["generation_settings"]["n_predict"] == 8 and answer["generation_settings"]["temperature"] == 0
    # streamed: the pieces join to the content; the last event is the whole answer without it; no [DONE]
    status, text = request(coder_server, "POST", "/infill", {**body, "stream": True})
    assert status == 200
    streamed = events(text)
    assert all(e["stop"] is False and e["content"] for e in streamed[:-1])
    assert "".join(e["content"] for e in streamed[:-1]) == content
    assert [e["tokens_predicted"] for e in streamed[:-1]] == sorted(e["tokens_predicted"] for e in streamed[:-1])
    last = streamed[-1]
    assert (last["stop"], last["content"], last["stop_type"], last["tokens_predicted"]) == \
        (True, "", stop_type, len(tokens))
    # the ids returned with return_tokens: the generated tokens
    status, text = request(coder_server, "POST", "/infill", {**body, "return_tokens": True})
    assert json.loads(text)["tokens"] == tokens
    # llama.vim's response_fields: those fields alone, nested ones by their path
    fields = ["content", "timings/prompt_n", "timings/predicted_n", "truncated", "tokens_cached"]
    status, text = request(coder_server, "POST", "/infill", {**body, "response_fields": fields})
    assert json.loads(text) == {"content": content, "timings/prompt_n": len(ids), "timings/predicted_n": len(tokens),
                                "truncated": False, "tokens_cached": len(ids) + len(tokens)}


def test_a_stop_word_and_n_predict_0(coder_server, coder):  # noqa: F811
    tokenizer = coder[1]
    body = {**CODE, "n_predict": 8, "temperature": 0}
    whole = json.loads(request(coder_server, "POST", "/infill", body)[1])["content"]
    assert len(whole) >= 3  # (the fixture's greedy middle)
    word = whole[1:3]
    for stream in (False, True):
        status, text = request(coder_server, "POST", "/infill", {**body, "stop": [word], "stream": stream})
        if stream:
            streamed = events(text)
            answer = {**streamed[-1], "content": "".join(e["content"] for e in streamed[:-1])}
        else:
            answer = json.loads(text)
        assert (answer["content"], answer["stop_type"], answer["stopping_word"]) == \
            (whole[:whole.index(word)], "word", word)
    # n_predict 0 (the editors' warm-up of their extra context): the prompt runs, nothing is generated
    metrics = coder_server["scheduler"].metrics
    before = metrics.prompt_tokens
    ids = expected_prompt(tokenizer, "", "", CODE["input_extra"], "")
    status, text = request(coder_server, "POST", "/infill", {"input_prefix": "", "input_suffix": "", "prompt": "",
                                                             "input_extra": CODE["input_extra"], "n_predict": 0,
                                                             "samplers": [], "response_fields": [""]})
    assert (status, json.loads(text)) == (200, {})
    assert metrics.prompt_tokens - before == len(ids)
    answer = json.loads(request(coder_server, "POST", "/infill", {**CODE, "n_predict": 0})[1])
    assert (answer["content"], answer["tokens_predicted"], answer["stop_type"]) == ("", 0, "limit")


def test_the_output_runs_to_the_end_of_the_context(coder_server, coder):  # noqa: F811
    """n_predict -1: until an end token or the context is full (llama.cpp's truncated)."""
    _, tokenizer, reference = coder
    ends = cli_serve.eos_ids(reference, tokenizer) + list(fill_in_middle_tokens(tokenizer).end)
    ids = expected_prompt(tokenizer, CODE["input_prefix"], CODE["input_suffix"], CODE["input_extra"], "x")
    tokens = reference_tokens(reference, ids, 96 - len(ids), ends).tolist()
    answer = json.loads(request(coder_server, "POST", "/infill", {**CODE, "temperature": 0, "n_predict": -1})[1])
    assert (answer["content"], answer["tokens_predicted"]) == (tokenizer.decode(tokens, skip_special_tokens=True),
                                                               len(tokens))
    assert answer["truncated"] == (tokens[-1] not in ends)


def test_llama_cpp_errors(coder_server, web, tmp_path):  # noqa: F811 (the fixtures)
    def error(body=None, **options):
        status, text = request(coder_server, "POST", "/infill", body, **options)
        answer = json.loads(text)
        assert set(answer) == {"error"}, text
        return status, answer["error"]
    status, err = error({"input_suffix": "x"})
    assert (status, err) == (400, {"code": 400, "message": "'input_prefix' is required",
                                   "type": "invalid_request_error"})
    status, err = error({**CODE, "input_extra": "x"})
    assert (status, err["type"]) == (400, "invalid_request_error") and "input_extra" in err["message"]
    status, err = error({**CODE, "repeat_penalty": 1.3})
    assert status == 400 and "repeat_penalty" in err["message"]
    status, err = error(raw="{not json")
    assert status == 400 and "JSON" in err["message"]
    status, err = error(CODE, key="wrong")
    assert (status, err["code"], err["type"]) == (401, 401, "authentication_error")
    status, err = error({**CODE, "prompt": "x " * 120})  # the typed text is never cut
    assert (status, err["type"], err["n_ctx"]) == (400, "exceed_context_size_error", 96)
    assert err["n_prompt_tokens"] > 96
    # the server goes on
    assert request(coder_server, "POST", "/infill", {**CODE, "n_predict": 1})[0] == 200
    # a model without FIM tokens: llama.cpp's 501
    with serving_tiny(write_tiny_model(tmp_path)) as plain:
        status, text = request(plain, "POST", "/infill", CODE)
        err = json.loads(text)["error"]
        assert (status, err["code"], err["type"]) == (501, 501, "not_supported_error")
        assert err["message"].startswith("infill is not supported by this model: this model has no fill-in-the-middle")
