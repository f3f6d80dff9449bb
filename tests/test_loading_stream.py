"""Loading streams: from_pretrained reads, converts, uploads and drops one tensor at a time (models/lazy_weights.py).

Checked: the peak host memory of from_pretrained (tracemalloc, which numpy's allocations report to; measured in a
subprocess) on a 180 MB bfloat16 Llama stays within twice its largest tensor as float32 (once for a bfloat16
model) plus a fixed margin, well under the whole model, which loading held before; the same for a GGUF file expanded
with dequantize=True. The weights on the device are bit for bit those of a load that reads every tensor into a dict
first (and, for plain checkpoints, the stored values themselves): bfloat16 and float32 files, sharded, tied
embeddings, quantization="q4_k", the pre-quantized fixtures. Names and shapes are checked before any tensor is read
or uploaded; the families' conversions (OLMo Hybrid's conv re-split, transposed fused experts) read lazily.
"""
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from vkformers import AutoModelForCausalLM
from vkformers.engine.quantized import QuantizedTensor, quant_format, quantize
from vkformers.engine.row_blocks import RowBlocks
from vkformers.models import loading
from vkformers.models.lazy_weights import LazyWeights, Weight
from vkformers.models.module import CheckpointError
from vkformers.models.safetensors_io import read_safetensors, write_safetensors
from vkformers.runtime import dtypes as dt

FIXTURES = Path(__file__).parent / "fixtures"
MiB = 1 << 20
MARGIN = 32 * MiB  # what loading needs besides the tensors: the model's bookkeeping, imports' caches, the reader


def llama_shapes(hidden, layers, vocab, intermediate, tied=False):
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                       **{p + f"self_attn.{n}_proj.weight": (hidden, hidden) for n in "qkvo"},
                       p + "mlp.gate_proj.weight": (intermediate, hidden),
                       p + "mlp.up_proj.weight": (intermediate, hidden),
                       p + "mlp.down_proj.weight": (hidden, intermediate)})
    return shapes


def write_llama(folder, *, hidden=256, layers=2, vocab=64, intermediate=512, dtype="bfloat16", tied=False,
                shards=1, seed=0, head_copy=False) -> dict:
    """A random Llama checkpoint (heads of 64); returns its tensors as float32 (the values stored)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
              "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": hidden // 64,
              "num_key_value_heads": hidden // 64, "vocab_size": vocab, "max_position_embeddings": 64,
              "rms_norm_eps": 1e-5, "tie_word_embeddings": tied, "torch_dtype": dtype}
    (folder / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)
    shapes = llama_shapes(hidden, layers, vocab, intermediate, tied)
    if head_copy:  # a tied model whose file holds the head anyway (loading keeps the embeddings' tensor)
        shapes["lm_head.weight"] = (vocab, hidden)
    stored = {n: (rng.standard_normal(s, np.float32) * 0.05).astype(np.float32) for n, s in shapes.items()}
    if dtype == "bfloat16":
        stored = {n: dt.to_bfloat16(a) for n, a in stored.items()}
    names = list(stored)
    if shards == 1:
        write_safetensors(folder / "model.safetensors", stored, bfloat16=set(stored) if dtype == "bfloat16" else set())
    else:
        weight_map = {}
        for k in range(shards):
            file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: stored[n] for n in names[k::shards]}
            write_safetensors(folder / file, part, bfloat16=set(part) if dtype == "bfloat16" else set())
            weight_map.update(dict.fromkeys(part, file))
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return {n: dt.from_bfloat16(a) if dtype == "bfloat16" else a for n, a in stored.items()}


# ---------------------------------------------------------------- peak host memory

MEASURE = """
import gc, json, sys, tracemalloc
from vkformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained(sys.argv[1])  # imports, kernels, device: before measuring
peaks = []
tracemalloc.start()
for path, options in json.loads(sys.argv[2]):
    gc.collect()
    tracemalloc.reset_peak()
    start = tracemalloc.get_traced_memory()[0]
    model = AutoModelForCausalLM.from_pretrained(path, **options)
    peaks.append(tracemalloc.get_traced_memory()[1] - start)
    del model
print(json.dumps(peaks))
"""


def peak_host_memory(loads) -> list[int]:
    """The peak traced host memory of each ``(path, options)`` from_pretrained, in a fresh process."""
    done = subprocess.run([sys.executable, "-c", MEASURE, str(FIXTURES / "llama"), json.dumps(loads)],
                          capture_output=True, text=True, env=os.environ.copy(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def write_f16_gguf(path, hidden, layers, vocab, intermediate):
    """The same Llama as a llama.cpp file of float16 matrices (float32 norms)."""
    import gguf  # the optional [gguf] extra
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(hidden // 64)
    writer.add_head_count_kv(hidden // 64)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    gguf_names = {"model.embed_tokens": "token_embd", "lm_head": "output", "model.norm": "output_norm",
                  "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
                  "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                  "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    rng = np.random.default_rng(1)
    for name, shape in llama_shapes(hidden, layers, vocab, intermediate).items():
        stem = name[:-len(".weight")]
        if stem.startswith("model.layers."):
            _, _, index, rest = stem.split(".", 3)
            stem = f"blk.{index}.{gguf_names[rest]}"
        else:
            stem = gguf_names[stem]
        array = rng.standard_normal(shape, np.float32) * 0.05
        writer.add_tensor(f"{stem}.weight", array.astype(np.float16) if len(shape) == 2 else array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_peak_host_memory_is_about_one_tensor_not_the_model(tmp_path):
    """hidden 1024, 4 layers, vocab 32000, bfloat16 (180 MB on disk): the embeddings and the head are the largest
    tensors, 125 MiB each as float32, the model 362 MiB. Reading every tensor into a dict first (as loading did)
    peaks above the whole model in float32: 487 MiB for a float32 model, 737 MiB for a bfloat16 one, 489 MiB for
    the GGUF file. Streamed: 250, 125 and 253 MiB, 2x the largest tensor (its float32 copy and the upload's buffer),
    and for a bfloat16 model one float32 size (the stored bits go to the device without widening)."""
    hidden, layers, vocab, intermediate = 1024, 4, 32000, 1024
    write_llama(tmp_path / "big", hidden=hidden, layers=layers, vocab=vocab, intermediate=intermediate)
    shapes = llama_shapes(hidden, layers, vocab, intermediate)
    largest = max(int(np.prod(s)) for s in shapes.values()) * 4
    whole = sum(int(np.prod(s)) for s in shapes.values()) * 4
    assert 2 * largest + MARGIN < whole  # the bound tells streaming from holding the model
    loads = [(str(tmp_path / "big"), {}), (str(tmp_path / "big"), {"dtype": "bfloat16"})]
    if importlib.util.find_spec("gguf") is not None:
        write_f16_gguf(tmp_path / "big.gguf", hidden, layers, vocab, intermediate)
        loads.append((str(tmp_path / "big.gguf"), {"dequantize": True}))
    peaks = peak_host_memory(loads)
    report = ", ".join(f"{options or 'float32'}: {peak / MiB:.0f} MiB" for (_, options), peak in zip(loads, peaks))
    assert peaks[0] < 2 * largest + MARGIN, report
    assert peaks[1] < largest + MARGIN, report
    if len(peaks) > 2:  # a GGUF file expanded as it is read, one tensor at a time too
        assert peaks[2] < 2 * largest + MARGIN, report


# ---------------------------------------------------------------- the same weights as a load read all at once

def stored_bits(tensor) -> np.ndarray:
    """A parameter's device buffer as it is (bfloat16 as its uint16 bits)."""
    return tensor.lazy.base.buffer.read()


def device_bytes(model) -> dict[str, bytes]:
    """Every parameter's device contents (packed blocks as they are) with its dtype or block format, by name."""
    out = {}
    for name, tensor in model.named_parameters():
        parts = tensor.parts if isinstance(tensor, RowBlocks) else [tensor]
        out[name] = b"".join(f"{p.format.name}:".encode() + stored_bits(p.packed).tobytes()
                             if isinstance(p, QuantizedTensor) else
                             f"{p.dtype.name}:".encode() + stored_bits(p).tobytes() for p in parts)
    return out


def load_read_all_at_once(monkeypatch, folder, **options):
    """from_pretrained with every tensor read into a dict before any upload (the loading of before)."""
    lazy = loading.read_weights
    with monkeypatch.context() as patch:
        patch.setattr(loading, "read_weights", lambda *args, **kwargs: dict(lazy(*args, **kwargs)))
        return AutoModelForCausalLM.from_pretrained(folder, **options)


def assert_same_weights(streamed, eager):
    got, want = device_bytes(streamed), device_bytes(eager)
    assert list(got) == list(want)
    for name in want:
        assert got[name] == want[name], name


@pytest.mark.parametrize("stored, options", [("bfloat16", {}), ("bfloat16", {"dtype": "bfloat16"}),
                                             ("bfloat16", {"dtype": "float16"}), ("float32", {}),
                                             ("float32", {"dtype": "bfloat16"})])
def test_plain_checkpoint_weights_are_the_stored_values(monkeypatch, tmp_path, stored, options):
    values = write_llama(tmp_path, dtype=stored)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, **options)
    assert_same_weights(model, load_read_all_at_once(monkeypatch, tmp_path, **options))
    target = dt.as_dtype(options.get("dtype", "float32"))
    for name, tensor in model.named_parameters():
        want = values[name] if target is dt.float32 else \
            dt.from_bfloat16(dt.to_bfloat16(values[name])) if target is dt.bfloat16 else values[name].astype(np.float16)
        np.testing.assert_array_equal(tensor.numpy(), want, err_msg=name)


def test_bfloat16_bits_go_to_the_device_as_stored_nan_as_before(monkeypatch, tmp_path):
    """A bfloat16 file read into a bfloat16 model without widening: every NaN pattern becomes 0x7FC0, as the
    float32 round trip made it; every other pattern stays."""
    write_llama(tmp_path)
    file = tmp_path / "model.safetensors"
    stored = {n: e.array.copy() for n, e in read_safetensors(file).items()}
    norm = "model.norm.weight"
    stored[norm][:5] = [0x7FC1, 0xFF91, 0x7F80, 0xFF80, 0x8000]  # two NaNs, +inf, -inf, -0
    write_safetensors(file, stored, bfloat16=set(stored))
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype="bfloat16")
    assert_same_weights(model, load_read_all_at_once(monkeypatch, tmp_path, dtype="bfloat16"))
    parameters = dict(model.named_parameters())
    np.testing.assert_array_equal(stored_bits(parameters[norm]), [0x7FC0, 0x7FC0, *stored[norm][2:]])
    for name, bits in stored.items():
        if name != norm:
            np.testing.assert_array_equal(stored_bits(parameters[name]), bits, err_msg=name)


def test_sharded_checkpoint_streams(monkeypatch, tmp_path):
    values = write_llama(tmp_path, shards=3)
    assert len(list(tmp_path.glob("model-*.safetensors"))) == 3
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert_same_weights(model, load_read_all_at_once(monkeypatch, tmp_path))
    for name, tensor in model.named_parameters():
        np.testing.assert_array_equal(tensor.numpy(), values[name], err_msg=name)


@pytest.mark.parametrize("head_copy", [False, True])
def test_tied_embeddings(monkeypatch, tmp_path, head_copy):
    """The head shares the embeddings' tensor, whether or not the file holds a copy of it."""
    values = write_llama(tmp_path, tied=True, head_copy=head_copy, dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype="bfloat16")
    assert_same_weights(model, load_read_all_at_once(monkeypatch, tmp_path, dtype="bfloat16"))
    slots = dict(model.named_slots())
    embeddings = slots["model.embed_tokens.weight"].tensor
    assert slots["lm_head.weight"].tensor is embeddings
    np.testing.assert_array_equal(stored_bits(embeddings), dt.to_bfloat16(values["model.embed_tokens.weight"]))


def test_quantization_while_loading(monkeypatch, tmp_path):
    """q4_k packs each Linear weight as it is read: the blocks quantize() gives the stored values."""
    values = write_llama(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization="q4_k")
    assert_same_weights(model, load_read_all_at_once(monkeypatch, tmp_path, quantization="q4_k"))
    weights = dict(model.named_parameters())
    for name in ("model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"):
        assert isinstance(weights[name], QuantizedTensor)
        np.testing.assert_array_equal(stored_bits(weights[name].packed), quantize(values[name], quant_format("q4_k")))
    assert not isinstance(weights["lm_head.weight"], QuantizedTensor)  # the head stays in the compute dtype


@pytest.mark.parametrize("case", ["fp8", "gptq", "awq"])
@pytest.mark.parametrize("options", [{}, {"quantization": "q8_0"}, {"dtype": "bfloat16"}])
def test_prequantized_checkpoints_stream(monkeypatch, case, options):
    folder = FIXTURES / "prequantized" / case
    assert_same_weights(AutoModelForCausalLM.from_pretrained(folder, **options),
                        load_read_all_at_once(monkeypatch, folder, **options))


# ---------------------------------------------------------------- checks before reading, conversions that read lazily

class Unreadable(Weight):
    """A tensor of a known shape that fails the test if anything reads it."""

    def __init__(self, shape):
        super().__init__(shape, self.fail)

    @staticmethod
    def fail():
        raise AssertionError("a tensor was read before the names and shapes were checked")


def unreadable_llama(model, **changes) -> LazyWeights:
    weights = {name: Unreadable(slot.shape) for name, slot in model.named_slots() if slot.tied_to is None}
    weights.update(changes)
    return LazyWeights({name: w for name, w in weights.items() if w is not None})


def llama_model():
    return AutoModelForCausalLM.from_config(json.loads((FIXTURES / "llama" / "config.json").read_text()))


def test_names_and_shapes_are_checked_before_any_read_or_upload():
    model = llama_model()
    with pytest.raises(CheckpointError, match="lacks 1 tensor.*lm_head.weight"):
        model.load_state_dict(unreadable_llama(model, **{"lm_head.weight": None}))
    with pytest.raises(CheckpointError, match="1 tensor.* this model does not use: model.extra.weight"):
        model.load_state_dict(unreadable_llama(model, **{"model.extra.weight": Unreadable((2,))}))
    with pytest.raises(CheckpointError, match=r"tensor lm_head.weight: checkpoint shape \(47, 32\), model expects"):
        model.load_state_dict(unreadable_llama(model, **{"lm_head.weight": Unreadable((47, 32))}))
    assert all(slot.tensor is None for _, slot in model.named_slots())  # nothing went to the device


def test_a_misshapen_tensor_last_in_the_file_stops_the_load_before_any_upload(tmp_path):
    values = write_llama(tmp_path, dtype="float32")
    values["model.norm.weight"] = values["model.norm.weight"][:-1]
    write_safetensors(tmp_path / "model.safetensors", values)
    model = llama_model_like(tmp_path)
    with pytest.raises(CheckpointError, match="tensor model.norm.weight: checkpoint shape"):
        model.load_state_dict(loading.read_weights(tmp_path))
    assert all(slot.tensor is None for _, slot in model.named_slots())


def llama_model_like(folder):
    return AutoModelForCausalLM.from_config(loading.load_config(Path(folder)))


def test_load_state_dict_takes_a_dict_or_any_mapping():
    """A dict (the arrays in memory) or another Mapping (each value looked up when it is uploaded)."""
    folder = FIXTURES / "llama"
    arrays = {n: e.as_float() for n, e in read_safetensors(folder / "model.safetensors").items()}
    want = device_bytes(AutoModelForCausalLM.from_pretrained(folder))
    model = llama_model()
    model.load_state_dict(arrays)
    assert device_bytes(model) == want
    looked_up = CountedLookups(arrays)
    model = llama_model()
    model.load_state_dict(looked_up)
    assert device_bytes(model) == want
    assert sorted(looked_up.reads) == sorted(arrays)  # each tensor once: its shape comes with it


class CountedLookups(Mapping):
    """A Mapping that is no dict: its values are looked up one by one, and counted."""

    def __init__(self, arrays):
        self.arrays, self.reads = arrays, []

    def __getitem__(self, name):
        self.reads.append(name)
        return self.arrays[name]

    def __iter__(self):
        return iter(self.arrays)

    def __len__(self):
        return len(self.arrays)


def test_olmo_hybrid_convs_saved_as_equal_chunks_are_split_when_read(tmp_path):
    """transformers saves OLMo Hybrid's q/k/v convs as three equal chunks of the concatenated conv; loading re-splits
    them at the key, key and value widths (16, 16, 32 here: chunks of 22, 22, 20)."""
    config = json.loads((FIXTURES / "olmo_hybrid" / "config.json").read_text())
    config["linear_value_head_dim"] = 8  # value width 4 x 8 = 32 against key widths 2 x 8 = 16
    model = AutoModelForCausalLM.from_config(config)
    rng = np.random.default_rng(0)
    arrays = {name: rng.standard_normal(slot.shape).astype(np.float32) for name, slot in model.named_slots()
              if slot.tied_to is None}
    layer = next(name[:-len(".q_conv1d.weight")] for name in arrays if name.endswith(".q_conv1d.weight"))
    convs = [arrays.pop(f"{layer}.{n}_conv1d.weight") for n in "qkv"]
    assert [c.shape[0] for c in convs] == [16, 16, 32]
    full = np.concatenate(convs)
    for n, chunk in zip("qkv", np.array_split(full, 3)):  # torch.chunk's sizes: 22, 22, 20
        arrays[f"{layer}.{n}_conv1d.weight"] = chunk
    (tmp_path / "config.json").write_text(json.dumps(config))
    write_safetensors(tmp_path / "model.safetensors", arrays)
    loaded = dict(AutoModelForCausalLM.from_pretrained(tmp_path).named_parameters())
    for n, conv in zip("qkv", convs):
        np.testing.assert_array_equal(loaded[f"{layer}.{n}_conv1d.weight"].numpy(), conv)


def test_fused_experts_stored_transposed_are_transposed_when_read(monkeypatch, tmp_path):
    """Qwen3-VL-MoE's fused experts may be stored [E, H, 2I] / [E, I, H] against the parameters' [E, 2I, H] /
    [E, H, I]: the same model either way."""
    folder = FIXTURES / "wrappers" / "qwen3_vl_moe"
    want = AutoModelForCausalLM.from_pretrained(folder)
    stored = read_safetensors(folder / "model.safetensors")
    arrays = {n: e.array for n, e in stored.items()}
    fused = [n for n in arrays if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert fused
    for name in fused:
        arrays[name] = np.ascontiguousarray(np.swapaxes(arrays[name], 1, 2))
    for file in folder.iterdir():
        if file.name != "model.safetensors":
            (tmp_path / file.name).write_bytes(file.read_bytes())
    write_safetensors(tmp_path / "model.safetensors", arrays,
                      bfloat16={n for n, e in stored.items() if e.code == "BF16"})
    assert_same_weights(AutoModelForCausalLM.from_pretrained(tmp_path), want)
