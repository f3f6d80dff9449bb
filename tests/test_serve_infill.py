"""llama.cpp's /infill prompt (models/fill_in_middle.py's infill_prompt), as llama.vscode and llama.vim send its parts.

The prompt is checked against llama.cpp's documented layout, written out here as token ids: with the vocabulary's
repository and file-separator tokens (Qwen2.5-Coder's repo-level pattern)
``<|repo_name|>myproject\\n<|file_sep|>{filename}\\n{text}...<|file_sep|>filename\\n<|fim_prefix|>{prefix}{prompt}
<|fim_suffix|>{suffix}<|fim_middle|>``, without them each chunk after a "--- snippet ---" line, and cut to fit as
llama.cpp cuts it (the prefix's last 3/4 of the batch, the suffix's first 1/4, the extra context's last tokens).
"""
from __future__ import annotations

from test_fill_in_middle import QWEN, tiny_gguf
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

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
