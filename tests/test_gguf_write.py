"""save_pretrained of a quantized model: folder/model.gguf with its packed blocks as they are, config.json and the
tokenizer files beside it; from_pretrained(folder) reads it back with the same logits. NF4 is refused.

Needs the optional ``gguf`` package (the [gguf] extra), as tests/test_gguf.py.
"""
import json

import numpy as np
import pytest

from test_gguf import train_bpe
from vkformers.engine.quantized import QuantizedTensor
from vkformers.errors import QuantizationError
from vkformers.models.loading import AutoModelForCausalLM, AutoTokenizer
from vkformers.models.safetensors_io import write_safetensors

gguf = pytest.importorskip("gguf", reason="the gguf extra: pip install 'vkformers[gguf]'")

# Inner sizes of 256: whole Q4_K blocks.
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 1,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 256,
          "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
          "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
IDS = np.array([[5, 17, 42, 7, 99, 3], [8, 8, 120, 64, 1, 250]])


def packed_tensors(path) -> dict:
    """GGUF name -> (type name, raw bytes) of every tensor of a file."""
    return {t.name: (t.tensor_type.name, np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(str(path)).tensors}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A random tiny llama checkpoint with a byte-level BPE tokenizer.json beside it."""
    backend = train_bpe()
    vocab = backend.get_vocab_size()
    h, f, kv = CONFIG["hidden_size"], CONFIG["intermediate_size"], 128
    rng = np.random.default_rng(7)
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    p = "model.layers.0."
    shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                   p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                   p + "mlp.down_proj.weight": (h, f)})
    weights = {n: (1 + 0.1 * rng.standard_normal(s) if n.endswith("norm.weight") else 0.1 * rng.standard_normal(s))
               .astype(np.float32) for n, s in shapes.items()}
    folder = tmp_path_factory.mktemp("tiny_llama")
    write_safetensors(folder / "model.safetensors", weights)
    (folder / "config.json").write_text(json.dumps({**CONFIG, "vocab_size": vocab, "bos_token_id": 1,
                                                    "eos_token_id": 4}))
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "<|im_end|>",
                                                              "unk_token": "<unk>", "add_bos_token": False}))
    return folder


@pytest.mark.parametrize("quantization", ["q4_k", "q8_0"])
def test_quantized_at_load_saves_a_gguf_that_reloads_the_same(tiny_llama, tmp_path, quantization):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, quantization=quantization, requires_grad=False)
    assert any(isinstance(t, QuantizedTensor) for t in model.parameters())
    out = tmp_path / "saved"
    model.save_pretrained(out)
    assert (out / "model.gguf").is_file() and not list(out.glob("*.safetensors"))
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    reloaded = AutoModelForCausalLM.from_pretrained(out, requires_grad=False)
    want = dict(model.named_parameters())
    for name, tensor in reloaded.named_parameters():
        if isinstance(want[name], QuantizedTensor):
            assert tensor.format.name == quantization, name
            assert np.array_equal(tensor.packed.numpy(), want[name].packed.numpy()), name  # no requantization
        else:
            assert np.array_equal(tensor.numpy(), want[name].numpy()), name
    np.testing.assert_array_equal(reloaded(IDS).logits.numpy(), model(IDS).logits.numpy())
    source, saved = AutoTokenizer.from_pretrained(tiny_llama), AutoTokenizer.from_pretrained(out)
    gguf_tok = AutoTokenizer.from_pretrained(out / "model.gguf")  # the vocabulary inside the file
    for text in ("the capital of france is paris", "hello, café 12345!"):
        assert saved.encode(text) == source.encode(text) == gguf_tok.encode(text)
    assert gguf_tok.eos_token == "<|im_end|>"


def test_the_file_has_llama_cpp_names_types_and_metadata(tiny_llama, tmp_path):
    """gguf's reader sees llama.cpp's llama tensor names (gguf.TENSOR_NAMES of MODEL_ARCH.LLAMA), Q4_K matrices,
    F32 norms, embedding and head, and the metadata llama.cpp reads to run the model."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, quantization="q4_k", requires_grad=False)
    model.save_pretrained(tmp_path)
    reader = gguf.GGUFReader(str(tmp_path / "model.gguf"))
    names = gguf.TENSOR_NAMES
    expected = {names[t].format(bid=0) + ".weight" for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.LLAMA]
                if "{bid}" in names[t] and names[t].format(bid=0).split(".", 2)[2] in
                ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                 "ffn_down")}
    expected |= {"token_embd.weight", "output_norm.weight", "output.weight"}
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert set(types) == expected
    for name, kind in types.items():
        matrix = name.startswith("blk.") and not name.endswith("norm.weight")
        assert kind == ("Q4_K" if matrix else "F32"), name
    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    assert shapes["blk.0.attn_k.weight"] == [256, 128]  # ggml order: innermost first
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields["general.architecture"] == "llama"
    for key, value in {"llama.block_count": 1, "llama.embedding_length": 256, "llama.feed_forward_length": 256,
                       "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
                       "llama.rope.dimension_count": 64, "llama.context_length": 64,
                       "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2"}.items():
        assert fields[key] == value, key
    assert fields["llama.rope.freq_base"] == pytest.approx(10000.0)
    assert fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert len(fields["tokenizer.ggml.tokens"]) == len(fields["tokenizer.ggml.token_type"]) == CONFIG_VOCAB(tiny_llama)
    # q/k rows in llama.cpp's adjacent-pair rotary order: the reader's dequantized q is the model's, permuted
    from vkformers.models.gguf import permute_rotary_rows
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    got = gguf.quants.dequantize(q.data, q.tensor_type).reshape(256, 256)
    want = dict(model.named_parameters())["model.layers.0.self_attn.q_proj.weight"].numpy()
    np.testing.assert_array_equal(got, permute_rotary_rows(want, 4))


def CONFIG_VOCAB(folder):
    return json.loads((folder / "config.json").read_text())["vocab_size"]


def test_nf4_is_refused_in_one_line(tiny_llama, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, quantization="nf4", requires_grad=False)
    with pytest.raises(QuantizationError) as error:
        model.save_pretrained(tmp_path / "nf4")
    message = str(error.value)
    assert "\n" not in message and "NF4" in message and "dequantize" in message and "q4_k" in message
    assert not (tmp_path / "nf4").exists()


def test_smollm2_gguf_round_trip(tmp_path):
    """The bundled SmolLM2-135M-Instruct Q4_1 GGUF kept packed, saved and reloaded: every tensor's type and bytes
    as in the original file, the same tokenizer metadata, the same logits."""
    from vkformers.cli.generate import default_model
    from vkformers.errors import VkformersError
    try:
        path = default_model()
    except VkformersError as exc:
        pytest.skip(str(exc))
    model = AutoModelForCausalLM.from_pretrained(path, requires_grad=False)
    model.save_pretrained(tmp_path)
    original, saved = packed_tensors(path), packed_tensors(tmp_path / "model.gguf")
    assert set(saved) == set(original)
    for name, (kind, data) in original.items():
        assert saved[name][0] == kind, name
        assert saved[name][1] == data, name  # bit-identical blocks (q/k rows back in the file's order)
    fields = {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items() if k.startswith("tokenizer.")}
    written = {k: f.contents() for k, f in gguf.GGUFReader(str(tmp_path / "model.gguf")).fields.items()
               if k.startswith("tokenizer.")}
    assert written == fields
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, requires_grad=False)
    ids = np.array([[1, 4093, 198, 504, 3575, 282, 4649, 314]])
    np.testing.assert_array_equal(reloaded(ids).logits.numpy(), model(ids).logits.numpy())
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.encode("The capital of France is") == [504, 3575, 282, 4649, 314]


@pytest.mark.parametrize("fixture,architecture", [("mistral", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3")])
def test_other_families_save_and_reload(tmp_path, fixture, architecture):
    """The tiny fixtures of the other written families, quantized to Q8_0 at load and saved with a given
    tokenizer: the file's architecture and names are llama.cpp's, the file alone reads back as the same
    model_type (Mistral's sliding window kept), and the folder gives the same logits."""
    from pathlib import Path

    from vkformers.errors import VkformersError
    from vkformers.models import gguf as vkgguf
    from vkformers.models.tokenizer import PreTrainedTokenizer
    folder = Path(__file__).parent / "fixtures" / fixture
    model = AutoModelForCausalLM.from_pretrained(folder, quantization="q8_0", requires_grad=False)
    with pytest.raises(VkformersError, match="more than the model's vocab_size 48"):
        model.save_pretrained(tmp_path / "big", tokenizer=PreTrainedTokenizer(train_bpe()))
    tokenizer = PreTrainedTokenizer(small_byte_level_tokenizer(40), {"bos_token": "<s>", "eos_token": "</s>"})
    model.save_pretrained(tmp_path, tokenizer=tokenizer)
    reader = gguf.GGUFReader(str(tmp_path / "model.gguf"))
    assert reader.fields["general.architecture"].contents() == architecture
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == 48 and tokens[40:] == [f"[PAD{i}]" for i in range(40, 48)]  # one per embedding row
    assert {t.tensor_type.name for t in reader.tensors if t.name.endswith("attn_v.weight")} == {"Q8_0"}
    config, _, _ = vkgguf.load_gguf(tmp_path / "model.gguf", tokenizer=False)
    assert config["model_type"] == model.config["model_type"]
    if fixture == "mistral":
        assert config["sliding_window"] == model.config["sliding_window"]
    ids = np.array([[5, 17, 42, 7, 9, 3]])
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, requires_grad=False)
    np.testing.assert_array_equal(reloaded(ids).logits.numpy(), model(ids).logits.numpy())


def test_missing_gguf_package_names_the_extra(tiny_llama, tmp_path, monkeypatch):
    import sys

    from vkformers.errors import VkformersError
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, quantization="q8_0", requires_grad=False)
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf then raises ImportError
    with pytest.raises(VkformersError, match=r"needs the gguf package: pip install 'vkformers\[gguf\]'"):
        model.save_pretrained(tmp_path / "out")


def small_byte_level_tokenizer(size: int):
    """A byte-level BPE of ``size`` tokens (two specials, then single bytes), for the fixtures' small vocabularies."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())[:size - 2]
    backend = Tokenizer(models.BPE({t: i + 2 for i, t in enumerate(alphabet)} | {"<s>": 0, "</s>": 1}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return backend


def test_float_tensors_keep_their_dtype(tiny_llama, tmp_path):
    """A bfloat16 model's float tensors (norms, embedding, head) are written BF16, bit for bit."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, quantization="q8_0", dtype="bfloat16",
                                                 requires_grad=False)
    model.save_pretrained(tmp_path)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "model.gguf")).tensors}
    assert types["output_norm.weight"] == types["token_embd.weight"] == "BF16"
    assert types["blk.0.ffn_down.weight"] == "Q8_0"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype="auto", requires_grad=False)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    norm = "model.layers.0.input_layernorm.weight"
    assert np.array_equal(dict(reloaded.named_parameters())[norm].numpy(), dict(model.named_parameters())[norm].numpy())
    np.testing.assert_array_equal(reloaded(IDS).logits.numpy(), model(IDS).logits.numpy())


def test_an_architecture_without_a_writer_is_refused(tmp_path):
    from pathlib import Path
    model = AutoModelForCausalLM.from_pretrained(Path(__file__).parent / "fixtures" / "gemma", quantization="q8_0",
                                                 requires_grad=False)
    with pytest.raises(QuantizationError, match=r"quantized 'gemma' model: no GGUF writer .*written: llama, "
                                                r"mistral, qwen2, qwen3\); load it with dequantize=True"):
        model.save_pretrained(tmp_path)
