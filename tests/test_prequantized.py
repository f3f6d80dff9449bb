"""Pre-quantized checkpoints (models/prequantized.py): tests/fixtures/prequantized, from
tools/make_prequantized_fixtures.py.

The references here are written apart from the loader, from the formats' documentation: float8 e4m3fn bytes through
the 256 values torch gives them (meta.json) times their block's scale_inv; GPTQ's and AWQ's codes and zeros read
element by element out of their int32 words. meta.json also holds each weight's sum and sum of squares as the
fixture script's torch dequantization gave them. Checked: the loaded weights against the reference (FP8 exactly;
GPTQ/AWQ packed as Q4_1 within half a float16 ulp of z * s, the rounding of Q4_1's m = -z * s; dequantized ones
exactly); logits against a float32 model of the same weights (1e-5 of max |logit|); quantization= packing the
dequantized weights; compressed-tensors' per-channel FP8; desc_act's g_idx; one-line refusals; the CLI.
"""
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from vkformers.cli import main
from vkformers.engine.quantized import QuantizationError, QuantizedTensor, dequantize, quantize
from vkformers.models.loading import AutoModelForCausalLM, AutoTokenizer
from vkformers.models.safetensors_io import read_safetensors, write_safetensors
from vkformers.runtime import dtypes as dt

FIXTURES = Path(__file__).parent / "fixtures" / "prequantized"
TOKENIZER = Path(__file__).parent / "fixtures" / "cross_encoder" / "xlm-roberta-nli"  # 125 tokens, fits vocab 128
IDS = np.array([[0, 5, 17, 99, 42, 7, 127, 3]])
LOGIT_TOLERANCE = 1e-5  # of max |logit|


def meta(name):
    return json.loads((FIXTURES / name / "meta.json").read_text())


def stored(folder):
    return read_safetensors(Path(folder) / "model.safetensors")


def float_model(folder, weights):
    """A float32 model of ``weights`` (quantized names replaced), the rest of the fixture's tensors as stored."""
    config = json.loads((Path(folder) / "config.json").read_text())
    config.pop("quantization_config")
    arrays = {n: e.as_float() for n, e in stored(folder).items() if n.endswith(("norm.weight", "embed_tokens.weight"))}
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict({**arrays, **weights}, dtype="float32")
    return model.eval()


def logits(model):
    return model(input_ids=IDS).logits.numpy().astype(np.float64)


def assert_logits_close(got, want):
    assert np.abs(got - want).max() <= LOGIT_TOLERANCE * np.abs(want).max()


def write_raw_safetensors(path, tensors):
    """name -> (dtype code, shape, bytes): what write_safetensors cannot hold (float8)."""
    header, blobs, offset = {}, [], 0
    for name, (code, shape, data) in tensors.items():
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


def copy_with_config(tmp_path, name, **changes):
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# ---------------------------------------------------------------- FP8

def e4m3fn_values():
    return np.array([np.nan if v == "nan" else v for v in meta("fp8")["e4m3fn_values"]], np.float32)


def fp8_reference():
    """Each weight: its float8 bytes' values times its [48, 32] block's scale_inv, float32."""
    entries, values = stored(FIXTURES / "fp8"), e4m3fn_values()
    out = {}
    for name, entry in entries.items():
        if entry.code == "F8_E4M3":
            scale = entries[name + "_scale_inv"].array
            rows, cols = entry.array.shape
            expanded = np.repeat(np.repeat(scale, 48, axis=0), 32, axis=1)[:rows, :cols]
            out[name] = values[entry.array] * expanded
    return out


def test_float8_e4m3fn_decodes_every_byte_as_torch():
    got = dt.from_float8_e4m3fn(np.arange(256, dtype=np.uint8))
    np.testing.assert_array_equal(got, e4m3fn_values())  # NaN where torch has NaN (0x7f, 0xff)
    assert np.isnan(got[[0x7F, 0xFF]]).all() and np.isnan(got).sum() == 2 and np.nanmax(got) == 448.0
    np.testing.assert_array_equal(dt.from_float8_e5m2(np.array([0x3C, 0x7C, 0x01], np.uint8)),
                                  [1.0, np.inf, 2.0 ** -16])


def test_fp8_weights_are_dequantized_exactly():
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / "fp8")
    params, reference = dict(model.named_parameters()), fp8_reference()
    assert len(reference) == 7
    for name, want in reference.items():
        np.testing.assert_array_equal(params[name].numpy(), want, err_msg=name)
        total, squares = meta("fp8")["reference_stats"][name]
        w = want.astype(np.float64)
        assert abs(w.sum() - total) <= 1e-6 * np.abs(w).sum() and abs((w * w).sum() - squares) <= 1e-6 * squares
    assert_logits_close(logits(model), logits(float_model(FIXTURES / "fp8", reference)))


def test_fp8_packs_as_quantization_asks():
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / "fp8", quantization="q8_0")
    params = dict(model.named_parameters())
    for name, want in fp8_reference().items():
        assert isinstance(params[name], QuantizedTensor) and params[name].format.name == "q8_0"
        np.testing.assert_array_equal(params[name].numpy(), dequantize(quantize(want, "q8_0"), "q8_0", want.shape))


def test_compressed_tensors_per_channel_fp8(tmp_path):
    folder = tmp_path / "ct"
    folder.mkdir()
    rng = np.random.default_rng(0)
    tensors, reference, values = {}, {}, e4m3fn_values()
    for name, entry in stored(FIXTURES / "fp8").items():
        if name.endswith("_scale_inv"):
            continue
        if entry.code == "F8_E4M3":
            scale = (0.001 + 0.002 * rng.random((entry.array.shape[0], 1))).astype(np.float32)
            tensors[name + "_scale"] = ("F32", scale.shape, scale.tobytes())
            reference[name] = values[entry.array] * scale
        tensors[name] = (entry.code, entry.array.shape, np.ascontiguousarray(entry.array).tobytes())
    write_raw_safetensors(folder / "model.safetensors", tensors)
    config = json.loads((FIXTURES / "fp8" / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}
    (folder / "config.json").write_text(json.dumps(config))
    params = dict(AutoModelForCausalLM.from_pretrained(folder).named_parameters())
    for name, want in reference.items():
        np.testing.assert_array_equal(params[name].numpy(), want, err_msg=name)


@pytest.mark.parametrize("changes, words", [
    ({"activation_scheme": "static"}, ["'static'", "dynamic", 'quantization="q4_k"']),
    ({"weight_block_size": [64, 32]}, ["weight_scale_inv has shape", "re-download"]),
    ({"quant_method": "hqq"}, ["quant_method 'hqq'", 'quantization="q4_k"']),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, ["'pack-quantized'", "float-quantized"]),
])
def test_fp8_refusals_are_one_line(tmp_path, changes, words):
    folder = copy_with_config(tmp_path, "fp8", **changes)
    with pytest.raises(QuantizationError) as error:
        AutoModelForCausalLM.from_pretrained(folder)
    assert "\n" not in str(error.value) and all(w in str(error.value) for w in words), str(error.value)


# ---------------------------------------------------------------- GPTQ and AWQ

AWQ_NIBBLE_OF_COLUMN = np.array([0, 4, 1, 5, 2, 6, 3, 7])  # AWQ packs columns 0, 2, 4, 6, 1, 3, 5, 7 in nibbles 0..7


def nibble(words, shift):
    return (words.astype(np.int64) & 0xFFFFFFFF) >> shift & 15


def int4_reference(folder, method):
    """Each weight [out, in] as (q - z) * s in float32, with the codes q, zeros z and scales s of each element."""
    config = json.loads((Path(folder) / "config.json").read_text())["quantization_config"]
    entries = stored(folder)
    out = {}
    for name in [n for n in entries if n.endswith(".qweight")]:
        stem = name[:-len(".qweight")]
        qweight, qzeros = entries[name].array, entries[stem + ".qzeros"].array
        scales = entries[stem + ".scales"].array.astype(np.float32)
        n_out = scales.shape[1]
        i = np.arange(qweight.shape[0] * 8 if method == "gptq" else qweight.shape[0])[:, None]
        j = np.arange(n_out)[None, :]
        if method == "gptq":  # input i in nibble i % 8 of row i // 8; zeros stored as z - 1
            q = nibble(qweight[i // 8, j], 4 * (i % 8))
            groups = entries[stem + ".g_idx"].array.astype(np.int64)[:, None]
            z = nibble(qzeros[groups, j // 8], 4 * (j % 8)) + 1
        else:  # output j in nibble AWQ_NIBBLE_OF_COLUMN[j % 8] of word j // 8
            q = nibble(qweight[i, j // 8], 4 * AWQ_NIBBLE_OF_COLUMN[j % 8])
            groups = i // config["group_size"]
            z = nibble(qzeros[groups, j // 8], 4 * AWQ_NIBBLE_OF_COLUMN[j % 8])
        s = scales[groups, j]
        out[stem + ".weight"] = (((q - z) * s).T.astype(np.float32), z.T, s.T)
    return out


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_int4_weights_stay_packed_as_q4_1(method):
    """Q4_1's d = s exactly, m = -z * s in float16: each element within half a float16 ulp of z * s."""
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / method)
    params, reference = dict(model.named_parameters()), int4_reference(FIXTURES / method, method)
    assert len(reference) == 7
    for name, (want, z, s) in reference.items():
        assert isinstance(params[name], QuantizedTensor) and params[name].format.name == "q4_1"
        bound = np.spacing(np.abs(z * s).astype(np.float16)).astype(np.float32) / 2
        assert (np.abs(params[name].numpy() - want) <= bound * (1 + 1e-6)).all(), name
        total, squares = meta(method)["reference_stats"][name]
        w = want.astype(np.float64)
        assert abs(w.sum() - total) <= 1e-6 * np.abs(w).sum() and abs((w * w).sum() - squares) <= 1e-6 * squares
    packed_logits = logits(model)
    # the kernels against a float32 model of the packed values; the reference's within the float16 rounding of m
    assert_logits_close(packed_logits, logits(float_model(FIXTURES / method, {
        name: params[name].numpy() for name in reference})))
    want = logits(float_model(FIXTURES / method, {name: w for name, (w, _, _) in reference.items()}))
    assert np.abs(packed_logits - want).max() <= 2e-3 * np.abs(want).max()


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_int4_weights_dequantize_for_another_format(method):
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / method, quantization="q8_0")
    params = dict(model.named_parameters())
    for name, (want, _, _) in int4_reference(FIXTURES / method, method).items():
        assert params[name].format.name == "q8_0"
        np.testing.assert_array_equal(params[name].numpy(), dequantize(quantize(want, "q8_0"), "q8_0", want.shape))


def test_gptq_desc_act_dequantizes_by_g_idx(tmp_path):
    """desc_act's g_idx puts inputs of several groups in one run of 32: no Q4_1 block holds them, so the weights
    are dequantized, each input by its own group."""
    folder = copy_with_config(tmp_path, "gptq", desc_act=True)
    arrays = {name: entry.array for name, entry in stored(folder).items()}
    rng = np.random.default_rng(0)
    for name in [n for n in arrays if n.endswith(".g_idx")]:
        n_groups = arrays[name[:-len(".g_idx")] + ".scales"].shape[0]
        arrays[name] = rng.permutation(np.arange(len(arrays[name])) * n_groups // len(arrays[name])).astype(np.int32)
    write_safetensors(folder / "model.safetensors", arrays)
    model = AutoModelForCausalLM.from_pretrained(folder)
    params, reference = dict(model.named_parameters()), int4_reference(folder, "gptq")
    for name, (want, z, s) in reference.items():
        if name.endswith("down_proj.weight"):  # 128 inputs in 2 groups; the others' 64 inputs are one group
            assert not isinstance(params[name], QuantizedTensor)
            np.testing.assert_array_equal(params[name].numpy(), want, err_msg=name)
        else:  # every g_idx 0: still packed
            bound = np.spacing(np.abs(z * s).astype(np.float16)).astype(np.float32) / 2
            assert (np.abs(params[name].numpy() - want) <= bound * (1 + 1e-6)).all(), name
    assert_logits_close(logits(model), logits(float_model(folder, {n: p.numpy() for n, p in params.items()
                                                                   if n in reference})))


@pytest.mark.parametrize("method, changes, words", [
    ("gptq", {"bits": 8}, ["'gptq' of 8 bits", 'quantization="q4_k"']),
    ("gptq", {"checkpoint_format": "marlin"}, ["checkpoint_format 'marlin'", "original"]),
    ("gptq", {"checkpoint_format": "gptq_v2"}, ["'gptq_v2'"]),
    ("awq", {"version": "exllama"}, ["'awq' of version 'exllama'", "'gemm'"]),
    ("awq", {"bits": 3}, ["'awq' of 3 bits"]),
])
def test_int4_refusals_are_one_line(tmp_path, method, changes, words):
    folder = copy_with_config(tmp_path, method, **changes)
    with pytest.raises(QuantizationError) as error:
        AutoModelForCausalLM.from_pretrained(folder)
    assert "\n" not in str(error.value) and all(w in str(error.value) for w in words), str(error.value)


def test_generate_cli_runs_a_gptq_checkpoint(tmp_path, capsys):
    folder = tmp_path / "gptq"
    shutil.copytree(FIXTURES / "gptq", folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, folder / name)
    argv = ["generate", "--model", str(folder), "--prompt", "the cat", "--max-new-tokens", "4", "--dtype",
            "float32"]
    assert main(argv) == 0, capsys.readouterr().err
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("the cat", return_tensors="np")["input_ids"]
    out = AutoModelForCausalLM.from_pretrained(folder).generate(ids, max_new_tokens=4)
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert text.strip() and capsys.readouterr().out == text + "\n"
