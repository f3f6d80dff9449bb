"""Quantized weights: the block formats' products, lookups and gradients against the gguf package's dequantization
(and an NF4 reference written here) followed by float64 arithmetic; loading, refusals, QLoRA; the bundled
SmolLM2-135M-Instruct Q4_1 GGUF kept quantized against its dequantized float32 self.

Needs the ``gguf`` package (the [gguf] extra), as tests/test_gguf.py: its tests fail without it.
"""
import json

import numpy as np
import pytest

import gguf
import vkformers as vkf
from test_attention import rounded
from test_decode_fused import rms
from test_gguf import CONFIG, random_llama, train_bpe, write_tiny_gguf
from test_kernels_transformer import rope_reference
from vkformers.engine import functional as F
from vkformers.engine import lazy
from vkformers.engine.kernels import Operand
from vkformers.engine.kernels import decode as KD
from vkformers.engine.kernels import matmul_quant as KQ
from vkformers.engine.kernels.matmul import coopmat_supported
from vkformers.engine.ops import decode as fused_ops
from vkformers.engine.quantized import FORMATS, QuantizedArray, QuantizedTensor, quantize
from vkformers.engine.tensor import Tensor
from vkformers.errors import QuantizationError
from vkformers.runtime import dtypes as dt

FORMAT_NAMES = ("q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k", "nf4")
NF4_CODE = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
            0.7229568362236023, 1.0]  # bitsandbytes' NF4 code book
TOLERANCE = 1e-5  # relative to max |C|


def random_blocks(fmt, rows, cols, seed=0):
    """Random packed rows: every byte random but the scales, set to finite magnitudes (fp16 d, dmin; NF4's f32
    absmax), so every code of every field is exercised."""
    rng = np.random.default_rng(seed)
    f = FORMATS[fmt]
    raw = rng.integers(0, 256, size=(rows, cols // f.block, f.block_bytes), dtype=np.uint8)

    def put(offset, low, high, dtype):
        values = rng.uniform(low, high, raw.shape[:2]).astype(dtype)
        raw[..., offset:offset + values.itemsize] = values.view(np.uint8).reshape(*raw.shape[:2], -1)

    if fmt == "nf4":
        put(0, 0.5, 2.0, np.float32)
    elif fmt == "q6_k":
        put(208, 0.001, 0.01, np.float16)
    else:
        put(0, 0.005, 0.05, np.float16)
        if fmt in ("q4_1", "q4_k", "q5_k"):
            put(2, 0.005, 0.05, np.float16)
    return raw.reshape(rows, -1)


def reference_weights(packed, fmt, rows, cols):
    """float64 [rows, cols]: gguf.quants.dequantize, or NF4 unpacked here (absmax, then element 2i in the high
    nibble of byte i)."""
    if fmt == "nf4":
        blocks = packed.reshape(-1, 36)
        absmax = blocks[:, :4].copy().view(np.float32).astype(np.float64)
        nibbles = blocks[:, 4:]
        codes = np.empty((blocks.shape[0], 64), np.int64)
        codes[:, 0::2], codes[:, 1::2] = nibbles >> 4, nibbles & 15
        return (np.array(NF4_CODE, np.float64)[codes] * absmax).reshape(rows, cols)
    qtype = gguf.GGMLQuantizationType[fmt.upper()]
    return gguf.quants.dequantize(packed, qtype).astype(np.float64).reshape(rows, cols)


def run_product(device, x, packed, fmt, *, n, k, trans_w=True, **options):
    m = x.shape[0]
    a = device.upload(x)
    w = device.upload(packed.reshape(-1), dtype="uint8")
    c = device.buffer(m * n, "float32")
    device.run(lambda seq: KQ.matmul_quant(seq, a, w, c, FORMATS[fmt], m=m, n=n, k=k, trans_w=trans_w, **options))
    return c.read().reshape(m, n).astype(np.float64)


def relative_error(got, want):
    return np.abs(got - want).max() / np.abs(want).max()


# Paths: the matvec with k split over a workgroup (the GPU layout) or a column per invocation (the CPU one), and
# the tiled kernel with its default tile or small odd tiles whose K step (40) divides no K here (tails in m, n, k).
PATHS = {"matvec_split": dict(algorithm="matvec", split_k=True),
         "matvec_column": dict(algorithm="matvec", split_k=False), "tiled": dict(algorithm="tiled"),
         "tiled_tails": dict(algorithm="tiled", tile=KQ.QuantTileConfig(bm=16, bn=32, bk=40, tm=2, tn=4))}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_product_matches_dequantized_reference(device, fmt, path):
    block = FORMATS[fmt].block
    n, k = 45, 3 * block
    m = 5 if path.startswith("matvec") else 37
    packed = random_blocks(fmt, n, k, seed=1)
    x = np.random.default_rng(2).standard_normal((m, k)).astype(np.float32)
    got = run_product(device, x, packed, fmt, n=n, k=k, **PATHS[path])
    want = x.astype(np.float64) @ reference_weights(packed, fmt, n, k).T
    assert relative_error(got, want) < TOLERANCE


@pytest.mark.parametrize("tile", [None, KQ.QuantTileConfig(bm=16, bn=32, bk=40, tm=2, tn=4)])
@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_input_gradient_product(device, fmt, tile):
    """dX = dY @ W (W not transposed): the tiled kernel reading W's rows as its K."""
    block = FORMATS[fmt].block
    n, k, m = 45, 2 * block, 19
    packed = random_blocks(fmt, n, k, seed=3)
    g = np.random.default_rng(4).standard_normal((m, n)).astype(np.float32)
    got = run_product(device, g, packed, fmt, n=k, k=n, trans_w=False, tile=tile)
    want = g.astype(np.float64) @ reference_weights(packed, fmt, n, k)
    assert relative_error(got, want) < TOLERANCE


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_matvec_batches_tails_and_offsets(device, fmt):
    """The matvec for 1 to 8 rows of A in both layouts: k of more 32-weight units than a GPU workgroup has
    invocations and not a multiple of them, an odd n (the last workgroup's second column past n), A read 16
    bytes at a time (offset 0) or element by element (an offset of 3 elements), W read 16 bytes at a time
    (offset 0) or by words (an offset of 4 bytes)."""
    block = FORMATS[fmt].block
    k = block * -(-(32 * KQ.MATVEC_THREADS + 96) // block)
    assert (k // 32) % KQ.MATVEC_THREADS and k // 32 > KQ.MATVEC_THREADS
    n = 2 * KQ.MATVEC_COLS + 1
    packed = random_blocks(fmt, n, k, seed=12)
    w64 = reference_weights(packed, fmt, n, k)
    weights = {0: Operand(device.upload(packed.reshape(-1), dtype="uint8"), 0),
               4: Operand(device.upload(np.concatenate([np.zeros(4, np.uint8), packed.reshape(-1)]), dtype="uint8"), 4)}
    rng = np.random.default_rng(13)
    for m, skip, w_skip, split_k in ((1, 0, 0, True), (2, 3, 4, True), (3, 0, 4, True), (8, 3, 0, True),
                                     (8, 0, 0, True), (5, 3, 0, False), (4, 0, 4, False)):
        x = rng.standard_normal((m, k)).astype(np.float32)
        a = device.upload(np.concatenate([np.zeros(skip, np.float32), x.reshape(-1)]))
        c = device.buffer(m * n, "float32")
        device.run(lambda seq: KQ.matmul_quant(seq, Operand(a, skip), weights[w_skip], c, FORMATS[fmt], m=m, n=n, k=k,
                                               algorithm="matvec", split_k=split_k))
        got = c.read().reshape(m, n).astype(np.float64)
        assert relative_error(got, x.astype(np.float64) @ w64.T) < TOLERANCE, (m, skip, w_skip, split_k)


@pytest.mark.parametrize("dtype,tolerance", [("float16", 2e-3), ("bfloat16", 1.6e-2)])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_matvec_half_activations(device, fmt, dtype, tolerance):
    """16-bit A and C in the GPU matvec layout: A read as 8 halves per 16 bytes (offsets 0 and 8) or one by one
    (offset 3); within the result dtype's rounding."""
    n, k, m = 7, 512, 2
    packed = random_blocks(fmt, n, k, seed=14)
    w = device.upload(packed.reshape(-1), dtype="uint8")
    x = np.random.default_rng(15).standard_normal((m, k)).astype(np.float32)
    to_host = {"float16": lambda v: v.astype(np.float16), "bfloat16": dt.to_bfloat16}[dtype]
    to_float = {"float16": lambda v: v.astype(np.float32), "bfloat16": dt.from_bfloat16}[dtype]
    for skip in (0, 8, 3):
        stored = to_host(np.concatenate([np.zeros(skip, np.float32), x.reshape(-1)]))
        x_rounded = to_float(stored[skip:]).reshape(m, k).astype(np.float64)
        a = device.upload(stored, dtype=dtype)
        c = device.buffer(m * n, dtype)
        device.run(lambda seq: KQ.matmul_quant(seq, Operand(a, skip), w, c, FORMATS[fmt], m=m, n=n, k=k,
                                               algorithm="matvec", split_k=True))
        got = to_float(c.read()).reshape(m, n).astype(np.float64)
        want = x_rounded @ reference_weights(packed, fmt, n, k).T
        assert relative_error(got, want) < tolerance, skip


@pytest.mark.parametrize("dtype,tolerance", [("float16", 2e-3), ("bfloat16", 1.6e-2)])
@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_coopmat_product(device, fmt, dtype, tolerance):
    """The cooperative-matrix product (W dequantized into the staged tile) for x @ W^T and dY @ W: whole tiles
    (the unchecked loads) and tails in m, n and k; a device without the matrix type has no such path."""
    if not coopmat_supported(device, dtype):
        pytest.skip(f"{device.name} has no {dtype} cooperative matrix")
    to_host = {"float16": lambda v: v.astype(np.float16), "bfloat16": dt.to_bfloat16}[dtype]
    to_float = {"float16": lambda v: v.astype(np.float32), "bfloat16": dt.from_bfloat16}[dtype]
    block = FORMATS[fmt].block
    rng = np.random.default_rng(16)
    for m, n, k, trans_w in ((300, 200, 3 * block * -(-96 // block), True), (37, 45, 3 * block, True),
                             (300, 3 * block * -(-96 // block), 200, False), (19, 2 * block, 45, False)):
        w_rows, w_cols = (n, k) if trans_w else (k, n)
        packed = random_blocks(fmt, w_rows, w_cols, seed=17)
        stored = to_host(rng.standard_normal((m, k)).astype(np.float32))
        a = device.upload(stored, dtype=dtype)
        w = device.upload(packed.reshape(-1), dtype="uint8")
        c = device.buffer(m * n, dtype)
        device.run(lambda seq: KQ.matmul_quant(seq, a, w, c, FORMATS[fmt], m=m, n=n, k=k, trans_w=trans_w,
                                               algorithm="coopmat"))
        w64 = reference_weights(packed, fmt, w_rows, w_cols)
        want = to_float(stored).astype(np.float64) @ (w64.T if trans_w else w64)
        got = to_float(c.read()).reshape(m, n).astype(np.float64)
        assert relative_error(got, want) < tolerance, (m, n, k, trans_w)


def test_matvec_row_blocks(device):
    """More rows than one matvec dispatch takes (on a CPU device 32, on a GPU 8): blocks of rows."""
    n, k, m = 33, 64, 41
    packed = random_blocks("q8_0", n, k, seed=5)
    x = np.random.default_rng(6).standard_normal((m, k)).astype(np.float32)
    got = run_product(device, x, packed, "q8_0", n=n, k=k, algorithm="matvec")
    assert relative_error(got, x.astype(np.float64) @ reference_weights(packed, "q8_0", n, k).T) < TOLERANCE


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_linear_embedding_and_backward_through_ops(fmt):
    """F.linear on a batch [2, 3, k] and its gradient, F.embedding's rows, with a QuantizedTensor weight."""
    n, k = 24, FORMATS[fmt].block * 2
    packed = random_blocks(fmt, n, k, seed=7)
    weight = QuantizedTensor.upload(QuantizedArray(packed, fmt, (n, k)))
    w64 = reference_weights(packed, fmt, n, k)
    rng = np.random.default_rng(8)
    x_np = rng.standard_normal((2, 3, k)).astype(np.float32)
    x = Tensor(x_np, requires_grad=True)
    y = F.linear(x, weight)
    assert y.shape == (2, 3, n)
    assert relative_error(y.numpy().astype(np.float64), x_np.astype(np.float64) @ w64.T) < TOLERANCE
    g_np = rng.standard_normal((2, 3, n)).astype(np.float32)
    (y * Tensor(g_np)).sum().backward()
    assert relative_error(x.grad.numpy().astype(np.float64), g_np.astype(np.float64) @ w64) < TOLERANCE
    ids = np.array([[3, 0], [23, -1]], np.int32)
    rows = F.embedding(Tensor(ids), weight).numpy()
    np.testing.assert_array_equal(rows[ids >= 0], w64[ids[ids >= 0]].astype(np.float32))
    assert not rows[1, 1].any()  # an id outside the table reads a zero row


@pytest.mark.parametrize("dtype,tolerance", [("float16", 2e-3), ("bfloat16", 1.6e-2)])
def test_half_precision_activations(dtype, tolerance):
    """float16 / bfloat16 inputs and results (the sums in float32): within the result dtype's rounding."""
    n, k = 40, 64
    packed = random_blocks("q4_1", n, k, seed=9)
    weight = QuantizedTensor.upload(QuantizedArray(packed, "q4_1", (n, k)), dtype=dtype)
    x_np = np.random.default_rng(10).standard_normal((3, k)).astype(np.float32)
    x = Tensor(x_np).cast(dtype)
    for m_rows in (x, Tensor(np.tile(x_np, (30, 1))).cast(dtype)):  # matvec and tiled
        y = F.linear(m_rows, weight)
        assert y.dtype is dt.as_dtype(dtype)
        want = m_rows.float().numpy().astype(np.float64) @ reference_weights(packed, "q4_1", n, k).T
        assert relative_error(y.float().numpy().astype(np.float64), want) < tolerance


def test_quantizers_round_trip():
    """Host quantizers (loading a float checkpoint): NF4 to the nearest level of absmax-scaled values, Q4_K a
    valid block gguf decodes, within each format's rounding."""
    w = np.random.default_rng(11).standard_normal((8, 512)).astype(np.float32)
    for fmt, tolerance in (("nf4", 0.15), ("q4_k", 0.15), ("q5_k", 0.06), ("q4_0", 0.15), ("q8_0", 0.01)):
        back = reference_weights(quantize(w, fmt), fmt, 8, 512)
        assert relative_error(back, w) < tolerance, fmt
    nf4 = reference_weights(quantize(w, "nf4"), "nf4", 8, 512).reshape(-1, 64)
    absmax = np.abs(w.reshape(-1, 64)).max(axis=1, keepdims=True)
    expected = np.array(NF4_CODE)[np.abs(w.reshape(-1, 64, 1) / absmax[..., None] - np.array(NF4_CODE)).argmin(-1)]
    np.testing.assert_allclose(nf4, expected * absmax, rtol=1e-6)



@pytest.mark.parametrize("fmt, nmax", [("q4_k", 15), ("q5_k", 31)])
def test_k_quantizer_search_beats_min_max(fmt, nmax):
    """Q4_K / Q5_K from float weights: the scale and min search has a lower squared error than the plain min/max
    fit on normal weights and on heavy-tailed ones with rows of different scales (as trained matrices are), and
    gguf.quants.dequantize of its bytes is exactly the d * sc * q - dmin * m it fitted."""
    from vkformers.engine import quantized as Q
    rng = np.random.default_rng(41)
    normal = 0.02 * rng.standard_normal((64, 1024))
    heavy = 0.02 * rng.standard_t(3, (128, 1024)) * np.exp(0.5 * rng.standard_normal((128, 1))) \
        * (1 + 4 * (rng.random(1024) < 0.01))  # a few outlier columns
    quantizer = Q.q4_k_quantize if fmt == "q4_k" else Q.q5_k_quantize
    for w in (normal.astype(np.float32), heavy.astype(np.float32)):
        errors = {}
        for search in (False, True):
            packed = quantizer(w, search=search)
            back = reference_weights(packed, fmt, *w.shape)
            errors[search] = np.square(back - w).sum()
            d16, dmin16, sc, mn, q = Q._k_quantize(w, nmax, search)
            fitted = ((d16.astype(np.float32) * sc)[..., None] * q - (dmin16.astype(np.float32) * mn)[..., None])
            np.testing.assert_array_equal(Q.dequantize(packed, fmt, w.shape), fitted.reshape(w.shape))
        assert errors[True] < 0.96 * errors[False], errors


def test_bitsandbytes_double_quantized_absmax():
    """bitsandbytes' NF4 with double-quantized absmax (uint8 codes into a 256-entry map, per-256-block scales,
    an offset) expands to the absmax bitsandbytes computes."""
    from vkformers.engine.quantized import nf4_from_bitsandbytes
    rng = np.random.default_rng(12)
    rows, cols = 4, 128
    packed = rng.integers(0, 256, rows * cols // 2, dtype=np.uint8)
    code = np.linspace(-1, 1, 256).astype(np.float32)
    absmax_codes = rng.integers(0, 256, rows * cols // 64, dtype=np.uint8)
    nested = np.array([0.7], np.float32)
    ours = nf4_from_bitsandbytes(packed, absmax_codes, (rows, cols), nested_absmax=nested, nested_code=code,
                                 offset=0.25)
    absmax = code[absmax_codes].astype(np.float64) * 0.7 + 0.25
    nibbles = np.stack([packed >> 4, packed & 15], axis=-1).reshape(-1, 64)
    want = (np.array(NF4_CODE)[nibbles] * absmax.astype(np.float32)[:, None]).reshape(rows, cols)
    np.testing.assert_allclose(reference_weights(ours, "nf4", rows, cols), want, rtol=1e-6)


# ---------------------------------------------------------------------------------------------- models
def write_checkpoint(folder, config, weights):
    from vkformers.models.safetensors_io import write_safetensors
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    write_safetensors(folder / "model.safetensors", weights)
    return folder


LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 320, "tie_word_embeddings": True,
         **CONFIG}


@pytest.mark.parametrize("fmt", ["nf4", "q8_0", "q4_1"])
def test_from_pretrained_quantization(tmp_path, fmt):
    """quantization= packs the Linear weights (not embeddings, norms or the head) while loading; a weight whose
    inner size is not a multiple of the block (down_proj, 96 wide, for NF4's 64) stays float, with one
    warning; the logits are those of the float model holding the dequantized weights."""
    from vkformers.models.loading import AutoModelForCausalLM
    weights = random_llama(320, seed=13)
    folder = write_checkpoint(tmp_path / "hf", LLAMA, weights)
    if fmt == "nf4":
        with pytest.warns(UserWarning, match=r"nf4: 2 weight\(s\) whose inner size is not a multiple of 64 stay in"):
            model = AutoModelForCausalLM.from_pretrained(folder, quantization=fmt, requires_grad=False)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, quantization=fmt, requires_grad=False)
    params = dict(model.named_parameters())
    quantized = {name for name, t in params.items() if isinstance(t, QuantizedTensor)}
    expected = {n for n in weights if n.endswith("proj.weight") and not (fmt == "nf4" and "down_proj" in n)}
    assert quantized == expected
    dequantized = {name: (params[name].numpy() if name in quantized else array) for name, array in weights.items()}
    reference = AutoModelForCausalLM.from_pretrained(write_checkpoint(tmp_path / "ref", LLAMA, dequantized),
                                                     requires_grad=False)
    ids = np.array([[5, 17, 42, 7, 99, 3]])
    got, want = model(ids).logits.numpy(), reference(ids).logits.numpy()
    assert relative_error(got.astype(np.float64), want.astype(np.float64)) < 1e-5


@pytest.mark.parametrize("fmt", ["q4_k", "q5_k"])
def test_from_pretrained_k_formats(tmp_path, fmt):
    """Q4_K and Q5_K (blocks of 256) on a llama 256 wide: every projection packed, logits those of the dequantized
    model."""
    from vkformers.models.loading import AutoModelForCausalLM
    config = dict(LLAMA, hidden_size=256, intermediate_size=512, num_hidden_layers=1)
    rng = np.random.default_rng(19)
    layer = "model.layers.0."
    shapes = {"model.embed_tokens.weight": (320, 256), "model.norm.weight": (256,),
              layer + "input_layernorm.weight": (256,), layer + "post_attention_layernorm.weight": (256,),
              layer + "self_attn.q_proj.weight": (256, 256), layer + "self_attn.k_proj.weight": (128, 256),
              layer + "self_attn.v_proj.weight": (128, 256), layer + "self_attn.o_proj.weight": (256, 256),
              layer + "mlp.gate_proj.weight": (512, 256), layer + "mlp.up_proj.weight": (512, 256),
              layer + "mlp.down_proj.weight": (256, 512)}
    weights = {n: (1.0 + 0.1 * rng.standard_normal(s) if n.endswith("norm.weight") else 0.1 * rng.standard_normal(s))
               .astype(np.float32) for n, s in shapes.items()}
    model = AutoModelForCausalLM.from_pretrained(write_checkpoint(tmp_path / "hf", config, weights),
                                                 quantization=fmt, requires_grad=False)
    params = dict(model.named_parameters())
    assert {t.format.name for t in params.values() if isinstance(t, QuantizedTensor)} == {fmt}
    assert {n for n, t in params.items() if isinstance(t, QuantizedTensor)} == {n for n in weights if "proj" in n}
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        assert relative_error(params[name].numpy(), weights[name]) < 0.15  # Q4_K's rounding of the original
    dequantized = {n: (params[n].numpy() if "proj" in n else a) for n, a in weights.items()}
    reference = AutoModelForCausalLM.from_pretrained(write_checkpoint(tmp_path / "ref", config, dequantized),
                                                     requires_grad=False)
    ids = np.array([[5, 17, 42, 7, 99, 3]])
    got, want = model(ids).logits.numpy(), reference(ids).logits.numpy()
    assert relative_error(got.astype(np.float64), want.astype(np.float64)) < 1e-5


def bitsandbytes_nf4(weight, nested):
    """``weight`` as bitsandbytes saves a 4-bit NF4 Linear weight, and the values it dequantizes to (float64)."""
    blocks = weight.reshape(-1, 64).astype(np.float64)
    absmax = np.abs(blocks).max(axis=1)
    codes = np.abs(blocks[..., None] / absmax[:, None, None] - np.array(NF4_CODE)).argmin(-1).astype(np.uint8)
    parts = {"": (codes.reshape(-1, 2)[:, 0] << 4 | codes.reshape(-1, 2)[:, 1]).astype(np.uint8).reshape(-1, 1),
             ".quant_map": np.array(NF4_CODE, np.float32)}
    state = {"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": list(weight.shape)}
    if nested:  # absmax - offset quantized to a 256-entry code, one float scale per 256 blocks
        offset = np.float32(absmax.mean())
        code = np.linspace(-1, 1, 256).astype(np.float32)
        scale = np.abs(absmax - offset).max().astype(np.float32)
        index = np.abs((absmax - offset)[:, None] / scale - code).argmin(-1).astype(np.uint8)
        parts.update({".absmax": index, ".nested_absmax": np.array([scale], np.float32), ".nested_quant_map": code})
        state.update(nested_blocksize=256, nested_offset=float(offset))
        absmax = (code[index] * scale + offset).astype(np.float32)
    else:
        absmax = absmax.astype(np.float32)
        parts[".absmax"] = absmax
    parts[".quant_state.bitsandbytes__nf4"] = np.frombuffer(json.dumps(state).encode(), np.uint8).copy()
    values = np.array(NF4_CODE)[codes] * absmax.astype(np.float64)[:, None]
    return parts, values.reshape(weight.shape)


@pytest.mark.parametrize("nested", [False, True])
def test_bitsandbytes_nf4_checkpoint(tmp_path, nested):
    """A checkpoint saved with bitsandbytes' NF4 (plain or double-quantized absmax) loads packed, with the
    logits of the float model holding the values bitsandbytes dequantizes to."""
    from vkformers.models.loading import AutoModelForCausalLM
    weights = random_llama(320, seed=20)
    packed, reference = {}, {}
    for name, array in weights.items():
        if name.endswith(("q_proj.weight", "gate_proj.weight")):
            parts, values = bitsandbytes_nf4(array, nested)
            packed.update({name + suffix: part for suffix, part in parts.items()})
            reference[name] = values.astype(np.float32)
        else:
            packed[name] = reference[name] = array
    model = AutoModelForCausalLM.from_pretrained(write_checkpoint(tmp_path / "bnb", LLAMA, packed), requires_grad=False)
    params = dict(model.named_parameters())
    assert {n for n, t in params.items() if isinstance(t, QuantizedTensor)} == \
        {n for n in weights if n.endswith(("q_proj.weight", "gate_proj.weight"))}
    np.testing.assert_allclose(params["model.layers.1.mlp.gate_proj.weight"].numpy(),
                               reference["model.layers.1.mlp.gate_proj.weight"], rtol=1e-6)
    want_model = AutoModelForCausalLM.from_pretrained(write_checkpoint(tmp_path / "ref", LLAMA, reference),
                                                      requires_grad=False)
    ids = np.array([[5, 17, 42, 7, 99, 3]])
    got, want = model(ids).logits.numpy(), want_model(ids).logits.numpy()
    assert relative_error(got.astype(np.float64), want.astype(np.float64)) < 1e-5


def test_quantized_model_refusals(tmp_path):
    from vkformers.models.loading import AutoModelForCausalLM
    from vkformers.training.trainer import Trainer, TrainingConfig
    folder = write_checkpoint(tmp_path / "hf", LLAMA, random_llama(320, seed=14))
    nf4 = AutoModelForCausalLM.from_pretrained(folder, quantization="nf4")
    with pytest.raises(QuantizationError, match="save_pretrained refused: .* NF4 .*GGUF has no block type"):
        nf4.save_pretrained(tmp_path / "out")  # the GGUF formats are saved as GGUF (tests/test_gguf_write.py)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization="q8_0")
    with pytest.raises(QuantizationError, match="full fine-tuning refused: .*train LoRA adapters on top"):
        Trainer(model, TrainingConfig(), [])
    weight = dict(model.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
    with pytest.raises(QuantizationError, match="q8_0 weight is frozen"):
        weight.requires_grad = True
    with pytest.raises(QuantizationError, match="quantization='q3_k' is not supported"):
        AutoModelForCausalLM.from_pretrained(folder, quantization="q3_k")


def test_qlora_gradients_match_float_base(tmp_path):
    """LoRA on a Q8_0 base: the adapters' gradients equal those on a float base holding the dequantized
    weights (the backward through the quantized weight is dX = dY @ W in the same kernel)."""
    from vkformers.models.loading import AutoModelForCausalLM
    from vkformers.models.lora import LoraConfig, apply_lora
    weights = random_llama(320, seed=15)
    quantized = AutoModelForCausalLM.from_pretrained(write_checkpoint(tmp_path / "hf", LLAMA, weights),
                                                     quantization="q8_0")
    params = dict(quantized.named_parameters())
    dequantized = {n: (params[n].numpy() if isinstance(params[n], QuantizedTensor) else a) for n, a in weights.items()}
    reference = AutoModelForCausalLM.from_pretrained(write_checkpoint(tmp_path / "ref", LLAMA, dequantized))
    ids = np.array([[5, 17, 42, 7, 99, 3, 11, 250]])
    grads = []
    for model in (quantized, reference):
        apply_lora(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]), seed=0)
        for name, t in model.named_parameters():
            if name.endswith("lora_B.weight"):
                t.assign(Tensor(np.full(t.shape, 0.05, np.float32)))  # nonzero B: A gets a gradient too
        model.train()
        model(ids, labels=ids).loss.backward()
        grads.append({n: t.grad.numpy() for n, t in model.named_parameters() if t.requires_grad})
    assert set(grads[0]) == set(grads[1]) and len(grads[0]) == 12
    for name in grads[0]:
        assert relative_error(grads[0][name].astype(np.float64), grads[1][name].astype(np.float64)) < 1e-4, name


# ---------------------------------------------------------------------------------------------- GGUF
@pytest.fixture(scope="module")
def backend():
    return train_bpe()


@pytest.mark.parametrize("quant", ["Q4_0", "Q8_0", "Q4_1"])
def test_gguf_kept_quantized(backend, tmp_path, quant):
    """A GGUF file's block-quantized matrices stay packed (q/k rows restored to HF's order), and the model gives
    the logits of the same file loaded with dequantize=True."""
    from vkformers.models.loading import AutoModelForCausalLM
    path = write_tiny_gguf(tmp_path / "tiny.gguf", random_llama(backend.get_vocab_size(), seed=16, tied=False),
                           backend, quant=quant)
    kept = AutoModelForCausalLM.from_pretrained(path, requires_grad=False)
    expanded = AutoModelForCausalLM.from_pretrained(path, requires_grad=False, dequantize=True)
    kept_params, expanded_params = dict(kept.named_parameters()), dict(expanded.named_parameters())
    packed = {n for n, t in kept_params.items() if isinstance(t, QuantizedTensor)}
    assert packed == {n for n in kept_params if n.endswith("proj.weight") or n in ("model.embed_tokens.weight",
                                                                                      "lm_head.weight")}
    assert all(kept_params[n].format.name == quant.lower() for n in packed)
    for name in packed:
        np.testing.assert_array_equal(kept_params[name].numpy(), expanded_params[name].numpy())
    ids = np.array([[5, 17, 42, 7, 99, 3]])
    got, want = kept(ids).logits.numpy(), expanded(ids).logits.numpy()
    assert relative_error(got.astype(np.float64), want.astype(np.float64)) < 1e-5


def test_gguf_unsupported_block_type(backend, tmp_path):
    from vkformers.models.loading import AutoModelForCausalLM
    path = write_tiny_gguf(tmp_path / "q5.gguf", random_llama(backend.get_vocab_size(), seed=17), backend, quant="Q5_0")
    with pytest.raises(QuantizationError, match=r"GGUF tensor token_embd.weight: block type Q5_0 is not supported"):
        AutoModelForCausalLM.from_pretrained(path)
    assert AutoModelForCausalLM.from_pretrained(path, dequantize=True, requires_grad=False) is not None
    with pytest.raises(QuantizationError, match="applies to safetensors checkpoints"):
        AutoModelForCausalLM.from_pretrained(path, quantization="nf4")


# ---------------------------------------------------------------------------------------------- SmolLM2
def test_smollm2_q4_1_kept_quantized():
    """The bundled SmolLM2-135M-Instruct Q4_1 GGUF (Q8_0 embeddings, tied head) kept quantized: logits within
    1e-2 of its dequantized float32 self (relative to max |logit|), the same 32 greedy tokens on two prompts,
    and under 120 MB of device buffers; a forward allocates less than one of its MLP weights would take
    dequantized (no weight is expanded to memory)."""
    from vkformers.cli.generate import default_model
    from vkformers.errors import VkformersError
    from vkformers.models.loading import AutoModelForCausalLM
    from vkformers.runtime.vulkan import buffer_memory, reset_peak_buffer_memory
    try:
        path = default_model()
    except VkformersError as exc:
        pytest.skip(str(exc))
    before = buffer_memory()["live_bytes"]
    kept = AutoModelForCausalLM.from_pretrained(path, requires_grad=False)
    assert buffer_memory()["live_bytes"] - before < 120e6
    params = dict(kept.named_parameters())
    assert isinstance(params["model.embed_tokens.weight"], QuantizedTensor)
    assert params["model.embed_tokens.weight"].format.name == "q8_0"
    assert params["model.layers.0.mlp.down_proj.weight"].format.name == "q4_1"
    prompts = [np.array([[1, 4093, 198, 504, 3575, 282, 4649, 314]]), np.array([[19556, 905, 17, 216, 33, 34]])]
    live = buffer_memory()["live_bytes"]
    reset_peak_buffer_memory()
    kept(prompts[0]).logits.numpy()
    assert buffer_memory()["peak_bytes"] - live < 1536 * 576 * 4  # 1.8 MB of activations and logits here
    expanded = AutoModelForCausalLM.from_pretrained(path, requires_grad=False, dequantize=True)
    for ids in prompts:
        got, want = kept(ids).logits.numpy(), expanded(ids).logits.numpy()
        assert relative_error(got.astype(np.float64), want.astype(np.float64)) < 1e-2
        tokens = kept.generate(ids, max_new_tokens=32, do_sample=False)
        np.testing.assert_array_equal(tokens, expanded.generate(ids, max_new_tokens=32, do_sample=False))


def test_generate_cli_keeps_gguf_quantized(backend, tmp_path, capsys):
    """``vkformers generate --model x.gguf`` runs the file's blocks packed (--dequantize expands them);
    --quantization names a format for safetensors checkpoints and is refused for a GGUF file."""
    from vkformers.cli import build_parser, main
    from vkformers.cli import generate as cli_generate
    from vkformers.models.gguf import load_gguf_tokenizer
    path = write_tiny_gguf(tmp_path / "tiny.gguf", random_llama(backend.get_vocab_size(), seed=18), backend,
                           quant="Q8_0")
    kept = cli_generate.load_model(str(path), "auto")
    assert any(isinstance(t, QuantizedTensor) for t in kept.parameters())
    assert not any(isinstance(t, QuantizedTensor) for t in cli_generate.load_model(str(path), "auto",
                                                                                   dequantize=True).parameters())
    tok = load_gguf_tokenizer(path)
    ids = cli_generate.prompt_ids(tok, "the capital of france is", chat=False, system=None)
    out = kept.generate(ids, max_new_tokens=6, eos_token_id=[tok.eos_token_id])
    argv = ["generate", "--model", str(path), "--prompt", "the capital of france is", "--max-new-tokens", "6"]
    assert main(argv) == 0
    assert capsys.readouterr().out == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True) + "\n"
    assert build_parser().parse_args(["generate", "--quantization", "q4_k"]).quantization == "q4_k"
    assert main(["generate", "--model", str(path), "--prompt", "hi", "--quantization", "nf4"]) == 1
    assert "applies to safetensors checkpoints" in capsys.readouterr().err


# decode_matvec's launch shapes for packed weights (in subgroups of 32 lanes): this device's own and every shape
# bench/quant.py --sweep times (QUANT_SWEEP_SHAPES: what QUANT_LAUNCH may pick); on a CPU device (lavapipe) only these
# few, which take each path of the kernel (k split over a workgroup or not, several units in flight with a last step
# part empty, two units side by side sharing their scales, several pairs, several subgroups each with its own pairs),
# compiling them all there taking long.
CPU_QUANT_SHAPES = ((4, 2, 2, 1), (2, 1, 4, 1), (2, 1, 2, 1, 2), (1, 2, 1, 0, 2), (4, 1, 1, 0))


@pytest.fixture(params=["this device", *dict.fromkeys(KD.QUANT_SWEEP_SHAPES + CPU_QUANT_SHAPES)], ids=str)
def quant_launch(request, device, monkeypatch, fused_decode_kernel):
    if request.param != "this device":
        if device.is_cpu and request.param not in CPU_QUANT_SHAPES:
            pytest.skip("a GPU's launch shape: a CPU device takes CPU_QUANT_SHAPES")
        shape = (max(1, request.param[0] * 32 // device.limits["subgroup_size"]),) + request.param[1:]
        monkeypatch.setattr(KD, "launch_shape", lambda device, rows=1, quant=None, kind="plain": shape)
        lazy.clear_plan_cache()  # plans recorded with the other shape
    yield request.param
    lazy.clear_plan_cache()


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_fused_decode_with_quantized_weights(device, fmt, quant_launch, monkeypatch):
    """The fused decode-step products (decode_matvec's q_* variants) with packed weights: norm + bias + residual
    on an odd width for 1 row (float32) and 3 (bfloat16), the gated MLP (also with up in another format than gate),
    and q/k/v with the rotary embedding and the cache write (3 and 1 heads of 12: groups of pairs across q and k), in
    each launch shape; float32 within TOLERANCE of float64 on the exact dequantized weights, bfloat16 within its
    rounding. k holds 72 units of 32 weights: several steps of a subgroup's lanes, the last one part empty. On a CPU
    device the gated and q/k/v modes (the same units, other epilogues) for three formats, the mixed gated for Q4_K."""
    monkeypatch.setattr(fused_ops, "enabled", True)
    k = 2304
    rng = np.random.default_rng(18)

    def weight(n, seed, form=fmt):
        packed = random_blocks(form, n, k, seed=seed)
        return QuantizedTensor.upload(QuantizedArray(packed, form, (n, k))), reference_weights(packed, form, n, k)

    def tensor(shape, dtype="float32", scale=1.0):
        exact, host = rounded(rng.standard_normal(shape) * scale, dtype)
        return exact, Tensor(host, dtype=dtype) if dtype != "float32" else Tensor(host)

    def close(got, want, tolerance):
        assert relative_error(np.asarray(got, np.float64), want) < tolerance

    (wt, w), (gate_t, gate), (up_t, up) = weight(37, 19), weight(24, 20), weight(24, 21)
    g, gt = tensor((k,))
    with vkf.no_grad():
        for rows, dtype, tolerance in ((1, "float32", TOLERANCE), (3, "bfloat16", 1.6e-2)):
            x, xt = tensor((rows, 1, k), dtype)
            b, bt = tensor((37,), dtype)
            r, rt = tensor((rows, 1, 37), dtype)
            gd, gdt = tensor((k,), dtype)
            assert fused_ops.fusable(xt, [wt], fused_ops.FusedNorm(gdt, 1e-5))
            got = fused_ops.fused_linear(xt, wt, norm=fused_ops.FusedNorm(gdt, 1e-5), bias=bt, residual=rt,
                                         residual_scale=0.5)
            close(got.float().numpy(), r + 0.5 * (rms(x, gd, 1e-5) @ w.T + b), tolerance)
        if device.is_cpu and fmt not in ("q4_k", "q6_k", "q8_0"):
            return
        x, xt = tensor((1, 1, k))
        gs, gst = tensor((k,), scale=0.05)  # gate values of order 1: silu neither 0 nor the identity
        h = rms(x, gs, 1e-6)
        ups = [(up_t, up)]
        if fmt == "q4_k" or not device.is_cpu:  # up in another format than gate
            ups.append(weight(24, 25, "q6_k" if fmt != "q6_k" else "q8_0"))
        for up_tensor, up_weight in ups:
            got = fused_ops.fused_gated(xt, gate_t, up_tensor, norm=fused_ops.FusedNorm(gst, 1e-6)).numpy()
            close(got, h @ gate.T / (1 + np.exp(-(h @ gate.T))) * (h @ up_weight.T), TOLERANCE)

        heads, kv_heads, head_dim, capacity, start = 3, 1, 12, 5, 3
        (wq_t, wq), (wk_t, wk), (wv_t, wv) = weight(heads * head_dim, 22), weight(12, 23), weight(12, 24)
        x, xt = tensor((2, 1, k))
        h = rms(x, g, 1e-6)
        k_cache = vkf.parameter(np.zeros((2, kv_heads, capacity, head_dim), np.float32), requires_grad=False)
        v_cache = vkf.parameter(np.zeros((2, kv_heads, capacity, head_dim), np.float32), requires_grad=False)
        positions = np.array([[4], [9]], np.int32)
        inv_freq = (1.0 / 10000.0 ** (np.arange(0, head_dim, 2) / head_dim)).astype(np.float32)
        q = fused_ops.fused_qkv_rope_write(xt, wq_t, wk_t, wv_t, k_cache=k_cache, v_cache=v_cache,
                                           cache_start=Tensor(np.array([start], np.uint32)),
                                           positions=Tensor(positions), head_dim=head_dim,
                                           inv_freq=Tensor(inv_freq), norm=fused_ops.FusedNorm(gt, 1e-6)).numpy()
        caches = k_cache.numpy(), v_cache.numpy()
    h = h[:, 0]
    rotate = lambda t: rope_reference(t, positions, inv_freq, head_dim, False, 1.0)  # noqa: E731
    close(q, rotate((h @ wq.T).reshape(2, heads, 1, head_dim)), TOLERANCE)
    close(caches[0][:, :, start:start + 1], rotate((h @ wk.T).reshape(2, kv_heads, 1, head_dim)), TOLERANCE)
    close(caches[1][:, :, start:start + 1], (h @ wv.T).reshape(2, kv_heads, 1, head_dim), TOLERANCE)
    assert not caches[0][:, :, :start].any() and not caches[1][:, :, start + 1:].any()


@pytest.mark.parametrize("fmt", ("q4_0", "q4_1", "q8_0"))
def test_fused_decode_odd_units_and_half_word_rows(device, fmt, quant_launch, monkeypatch):
    """Blocks of 32 weights at k = 73 units: every other row of Q4_0 (18 bytes a block) and Q8_0 (34) starts 2 bytes
    into a word, the lanes' last step is part empty, and a launch of units side by side takes them one by one (73 is
    odd). The plain product (norm, bias, residual) and the gated one, within TOLERANCE of float64 on the dequantized
    weights."""
    monkeypatch.setattr(fused_ops, "enabled", True)
    k = 32 * 73
    rng = np.random.default_rng(41)

    def weight(n, seed):
        packed = random_blocks(fmt, n, k, seed=seed)
        return QuantizedTensor.upload(QuantizedArray(packed, fmt, (n, k))), reference_weights(packed, fmt, n, k)

    (wt, w), (gate_t, gate), (up_t, up) = weight(21, 42), weight(10, 43), weight(10, 44)
    # float32 values, their references in float64
    x, g, b, r = (rng.standard_normal(shape).astype(np.float32).astype(np.float64)
                  for shape in ((2, 1, k), (k,), (21,), (2, 1, 21)))
    gs = (0.05 * rng.standard_normal(k)).astype(np.float32).astype(np.float64)  # gate values of order 1
    t = lambda a: Tensor(a.astype(np.float32))  # noqa: E731
    with vkf.no_grad():
        got = fused_ops.fused_linear(t(x), wt, norm=fused_ops.FusedNorm(t(g), 1e-5), bias=t(b), residual=t(r)).numpy()
        gated = fused_ops.fused_gated(t(x), gate_t, up_t, norm=fused_ops.FusedNorm(t(gs), 1e-6)).numpy()
    assert relative_error(got.astype(np.float64), r + rms(x, g, 1e-5) @ w.T + b) < TOLERANCE
    h = rms(x, gs, 1e-6)
    want = h @ gate.T / (1 + np.exp(-(h @ gate.T))) * (h @ up.T)
    assert relative_error(gated.astype(np.float64), want) < TOLERANCE

def test_quant_launch_table(monkeypatch):
    """QUANT_LAUNCH: a (format, kind) line over the format's, the format's over the default; down_proj's shape (k at
    least twice the width) is its own kind."""
    assert KD.product_kind("plain", 14336, (4096,)) == "plain_long"
    assert KD.product_kind("plain", 4096, (4096,)) == "plain" and KD.product_kind("qkv", 4096, (4096,)) == "qkv"
    monkeypatch.setattr(KD, "QUANT_LAUNCH", {"q4_k": (2, 1, 1, 1), ("q4_k", "plain_long"): (8, 2, 2, 1)})
    assert KD.quant_launch("q4_k", "plain_long") == (8, 2, 2, 1)
    assert KD.quant_launch("q4_k", "gated") == (2, 1, 1, 1)
    assert KD.quant_launch("q6_k", "gated") == KD.QUANT_LAUNCH_DEFAULT
    assert all(len(s) in (4, 5) and s[0] * 32 <= 1024 for s in KD.QUANT_SWEEP_SHAPES)
    assert set(KD.QUANT_SWEEP_SHORT) <= set(KD.QUANT_SWEEP_SHAPES)


def test_fused_decode_mixed_block_formats(device, monkeypatch, fused_decode_kernel):
    """A Q4_K_M-style model (q, k, o, gate, up in Q4_K; v and down in Q6_K, as llama.cpp's Q4_K_M keeps attn_v and
    ffn_down) decodes through the fused kernels with each weight in its own format, none falling back to the composed
    ops, and gives the logits of its dequantized float32 self at every step (relative to max |logit|)."""
    from vkformers.engine.ops.decode import DecodeMatvec
    from vkformers.models.cache import KVCache
    from vkformers.models.loading import AutoModelForCausalLM
    monkeypatch.setattr(fused_ops, "enabled", True)
    config = dict(model_type="llama", hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=64, max_position_embeddings=64,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu")
    rng = np.random.default_rng(31)
    packed, dequantized = {}, {}
    model = AutoModelForCausalLM.from_config(config)
    for name, slot in model.named_slots():
        shape = tuple(slot.shape)
        if name.endswith("proj.weight"):
            fmt = "q6_k" if ("v_proj" in name or "down_proj" in name) else "q4_k"
            if fmt == "q4_k":
                blocks = quantize(0.05 * rng.standard_normal(shape).astype(np.float32), fmt)
            else:  # no Q6_K quantizer: random codes, d small enough for weights of order 0.05
                blocks = random_blocks(fmt, shape[0], shape[1], seed=int(rng.integers(1 << 30))).reshape(
                    shape[0], -1, 210)
                blocks[..., 208:210] = np.full(blocks.shape[:2], 3e-5, np.float16)[..., None].view(np.uint8)
                blocks = blocks.reshape(shape[0], -1)
            packed[name] = QuantizedArray(blocks, fmt, shape)
            dequantized[name] = reference_weights(blocks, fmt, *shape).astype(np.float32)
        else:
            value = (1.0 + 0.1 * rng.standard_normal(shape) if "norm" in name else 0.5 * rng.standard_normal(shape))
            packed[name] = dequantized[name] = value.astype(np.float32)
    model.load_state_dict(packed, requires_grad=False)
    reference = AutoModelForCausalLM.from_config(config)
    reference.load_state_dict(dequantized, requires_grad=False)
    seen = []
    emit = DecodeMatvec.emit
    monkeypatch.setattr(DecodeMatvec, "emit", lambda self, *a: (seen.append(self.attrs.get("quant")), emit(self, *a)))
    ids = np.array([[3, 17, 42, 9, 25, 60, 1, 33, 8, 51]])
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    caches = [KVCache(2, 1, 2, head_dim, max_len=16) for _ in range(2)]
    with vkf.no_grad():
        for step in range(5, ids.shape[1]):
            span = slice(0, step) if step == 5 else slice(step - 1, step)
            got = model(ids[:, span], cache=caches[0]).logits.numpy()[:, -1]
            want = reference(ids[:, span], cache=caches[1]).logits.numpy()[:, -1]
            assert relative_error(got.astype(np.float64), want.astype(np.float64)) < 1e-4, step
    assert {"q4_k,q4_k,q6_k", "q4_k", "q4_k,q4_k", "q6_k"} <= set(seen)
