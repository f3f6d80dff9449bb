"""AdamW with bfloat16 and 8-bit blockwise moments (bitsandbytes' AdamW8bit) against a numpy transcription of
the same algorithm (adamw.comp's float32 arithmetic), checkpoint resume of those states, and training with them."""
import numpy as np
import pytest

import vkformers as vkf
from test_training import tiny_data, tiny_model
from vkformers.engine.kernels.adamw import adamw_scalars
from vkformers.optim import QUANTIZATION_MAPS, AdamW, AdamW8bit, OptimizerConfigError, dynamic_map
from vkformers.runtime import dtypes as dt
from vkformers.training import Batches, Trainer, TrainingConfig

F32 = np.float32
HP = dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
SIGNED, UNSIGNED = QUANTIZATION_MAPS[:256], QUANTIZATION_MAPS[256:]
# Parameters against numpy after a few steps: Vulkan lets a GPU's division and sqrt be 2.5 and 3 ulp off (numpy's
# are correctly rounded), so the update may differ by a few ulp of itself (atol: 1e-5 of a step, lr) and the
# parameter then by its own rounding (rtol: 4e-7, about 3 ulp). Measured on an H200: 4.8e-7 absolute at |p| 2.2.
PARAM_TOL = dict(rtol=4e-7, atol=HP["lr"] * 1e-5)


def adam_float32(p, g, m, v, step):
    """adamw.comp's update in float32, with its scalars (bias corrections rounded from float64 as it gets them)."""
    s = adamw_scalars(lr=HP["lr"], step=step, beta1=HP["betas"][0], beta2=HP["betas"][1], eps=HP["eps"],
                      weight_decay=HP["weight_decay"]).view(F32)
    p = p * s[10]
    m = m + s[6] * (g - m)
    v = v * s[2] + s[7] * g * g
    denom = np.sqrt(v) / s[9] + s[3]
    return p - s[8] * (m / denom), m, v


def quantize(x, scale, qmap):
    """Index of the nearest map value to x / scale, decided on the midpoints times scale (as the kernel does)."""
    bounds = ((qmap[:-1] + qmap[1:]) * F32(0.5)) * scale
    return np.searchsorted(bounds, x, side="left").astype(np.uint8)


def adam_8bit_reference(p, grads, block):
    """The 8-bit blockwise AdamW: dequantize m, v per block, update in float32, requantize with new absmaxes."""
    n = p.size
    blocks = -(-n // block)
    codes_m, codes_v = np.full(n, 127, np.uint8), np.zeros(n, np.uint8)
    absmax_m, absmax_v = np.zeros(blocks, F32), np.zeros(blocks, F32)
    for step, g in enumerate(grads, 1):
        owner = np.arange(n) // block
        m = SIGNED[codes_m] * absmax_m[owner]
        v = UNSIGNED[codes_v] * absmax_v[owner]
        p, m, v = adam_float32(p, g, m, v, step)
        pad = blocks * block - n
        absmax_m = np.abs(np.pad(m, (0, pad))).reshape(blocks, block).max(1)
        absmax_v = np.pad(v, (0, pad)).reshape(blocks, block).max(1)
        codes_m = np.concatenate([quantize(m[b * block:(b + 1) * block], absmax_m[b], SIGNED) for b in range(blocks)])
        codes_v = np.concatenate([quantize(v[b * block:(b + 1) * block], absmax_v[b], UNSIGNED)
                                  for b in range(blocks)])
    return p, codes_m, codes_v, absmax_m, absmax_v


def run_optimizer(optimizer_class, p0, grads, **options):
    p = vkf.parameter(p0)
    opt = optimizer_class([p], **HP, **options)
    for g in grads:
        p.grad = vkf.tensor(g)
        opt.step()
        opt.zero_grad()
        p.numpy()
    return p.numpy(), opt.state[id(p)]


def test_dynamic_maps_are_bitsandbytes_layout():
    signed, unsigned = dynamic_map(True), dynamic_map(False)
    assert signed.shape == unsigned.shape == (256,)
    assert np.all(np.diff(signed) > 0) and np.all(np.diff(unsigned) > 0)  # 256 distinct values each
    assert signed[-1] == unsigned[-1] == 1.0 and unsigned[0] == 0.0 and 0.0 in signed
    assert -1.0 < signed[0] < -0.99 and 0 < unsigned[1] < 1e-6  # 7 decades down to 1e-7
    # the positive half of the signed map: one fraction per step of each decade's linspace(0.1, 1, 2^i + 1)
    assert np.isclose(signed[signed > 0][:1], 0.55e-6).all()


@pytest.mark.parametrize("size,block", [(3000, 256), (5000, 2048), (100, 256)])
def test_8bit_states_match_the_numpy_reference(size, block):
    """Codes and absmaxes bit for bit (the kernel computes the moments without fused multiply-adds and quantizes
    by products, so there is nothing to round differently); parameters within PARAM_TOL (sqrt and the division
    of the update may round differently on a GPU)."""
    rng = np.random.default_rng(size)
    p0 = rng.standard_normal(size).astype(F32)
    grads = [(rng.standard_normal(size) * 10.0 ** rng.uniform(-1, 0, size)).astype(F32) for _ in range(4)]
    p, state = run_optimizer(AdamW8bit, p0, grads, block_size=block, min_8bit_size=0)
    ref_p, codes_m, codes_v, absmax_m, absmax_v = adam_8bit_reference(p0, grads, block)
    np.testing.assert_array_equal(state["exp_avg"].numpy(), codes_m)
    np.testing.assert_array_equal(state["exp_avg_sq"].numpy(), codes_v)
    np.testing.assert_array_equal(state["exp_avg_absmax"].numpy(), absmax_m)
    np.testing.assert_array_equal(state["exp_avg_sq_absmax"].numpy(), absmax_v)
    np.testing.assert_allclose(p, ref_p, **PARAM_TOL)
    # and within a block of like magnitudes the 8-bit moments move the parameters as float32 AdamW does
    exact = run_optimizer(AdamW, p0, grads)[0]
    assert np.abs(p - exact).max() < 0.05 * np.abs(exact - p0).max()


def test_bfloat16_states_match_the_numpy_reference():
    rng = np.random.default_rng(1)
    p0 = rng.standard_normal(777).astype(F32)
    grads = [rng.standard_normal(777).astype(F32) for _ in range(3)]
    p, state = run_optimizer(AdamW, p0, grads, state_dtype="bfloat16")
    ref_p, m, v = p0, np.zeros(777, F32), np.zeros(777, F32)
    for step, g in enumerate(grads, 1):
        ref_p, m, v = adam_float32(ref_p, g, m, v, step)
        m, v = (dt.from_bfloat16(dt.to_bfloat16(x)) for x in (m, v))  # stored rounded to nearest even
    assert state["exp_avg"].dtype is dt.bfloat16
    np.testing.assert_array_equal(state["exp_avg"].numpy(), m)
    np.testing.assert_array_equal(state["exp_avg_sq"].numpy(), v)
    np.testing.assert_allclose(p, ref_p, **PARAM_TOL)


def test_state_memory_and_small_tensors():
    big, small = vkf.parameter(np.zeros(10_000, F32)), vkf.parameter(np.zeros(100, F32))
    opt = AdamW8bit([big, small])
    opt.init_state()
    nbytes = {n: t.numel() * t.dtype.itemsize for n, t in opt.state[id(big)].items() if n not in ("step", "master")
              and t is not None}
    assert nbytes == {"exp_avg": 10_000, "exp_avg_sq": 10_000, "exp_avg_absmax": 40 * 4, "exp_avg_sq_absmax": 40 * 4}
    assert opt.state[id(small)]["exp_avg"].dtype is dt.float32  # under min_8bit_size (4096), as bitsandbytes
    with pytest.raises(OptimizerConfigError, match="block_size"):
        AdamW([big], state_dtype="int8", block_size=512)
    with pytest.raises(OptimizerConfigError, match="state_dtype"):
        AdamW([big], state_dtype="float16")


def make_trainer(out, optim, steps=6, save_every=0, model_seed=0):
    config = TrainingConfig(steps=steps, batch_size=4, seq_len=16, lr=1e-2, warmup=2, schedule="cosine",
                            save_every=save_every, seed=3, weight_decay=0.01, optim=optim)
    return Trainer(tiny_model(seed=model_seed, dropout=0.1), config, Batches(tiny_data(), 4, seed=3), out_dir=out)


@pytest.mark.parametrize("optim", ["adamw_8bit", "adamw_bf16_states"])
def test_resume_is_exact_and_the_loss_decreases(tmp_path, optim):
    full = make_trainer(tmp_path / "a", optim, save_every=3)
    reference = [r["loss"] for r in full.train()]
    assert reference[-1] < reference[0] - 0.5
    kinds = {st["exp_avg"].dtype.name for st in full.optimizer.state.values()}
    assert kinds == ({"uint8", "float32"} if optim == "adamw_8bit" else {"bfloat16"})
    resumed = make_trainer(tmp_path / "b", optim, model_seed=99)
    resumed.resume(tmp_path / "a" / "checkpoints" / "checkpoint-3")
    assert [r["loss"] for r in resumed.train()] == reference[3:]
    for key, array in full.optimizer.state_dict().items():
        np.testing.assert_array_equal(resumed.optimizer.state_dict()[key], array, err_msg=key)


def test_resume_refuses_another_optimizer(tmp_path):
    from vkformers.training.checkpoint import CheckpointLoadError
    make_trainer(tmp_path, "adamw_8bit", steps=1, save_every=1).train()
    with pytest.raises(CheckpointLoadError, match="same --optim"):
        make_trainer(tmp_path, "adamw").resume()


def test_cli_train_with_8bit_states_and_gradient_checkpointing(tmp_path):
    import json
    from test_lora import tiny_llama_folder
    from vkformers.cli import main
    from vkformers.cli.train import OPTIMS
    from vkformers.models.safetensors_io import read_safetensors
    from vkformers.optim import OPTIMIZERS
    assert set(OPTIMS) == set(OPTIMIZERS)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question. " * 40)
    assert main(["train", "--model", str(tiny_llama_folder(tmp_path / "config")), "--from-scratch", "--tokenizer",
                 "byte", "--data", str(corpus), "--out", str(tmp_path / "run"), "--steps", "3", "--batch-size", "2",
                 "--seq-len", "16", "--no-progress", "--optim", "adamw_8bit", "--gradient-checkpointing"]) == 0
    folder = tmp_path / "run" / "checkpoints" / "checkpoint-3"
    config = json.loads((folder / "trainer_state.json").read_text())["config"]
    assert config["optim"] == "adamw_8bit" and config["gradient_checkpointing"] is True
    states = read_safetensors(folder / "optimizer.safetensors")
    assert states["0.0.exp_avg"].array.dtype == np.uint8  # the embedding (257 x 32): 8-bit codes
    assert states["0.0.exp_avg_absmax"].array.shape == (-(-257 * 32 // 256),)
    assert "0.0.master" not in states  # float32 weights: none


def test_cli_train_bf16_without_master_weights(tmp_path, capsys):
    import json
    from test_lora import tiny_llama_folder
    from vkformers.cli import main
    from vkformers.models.safetensors_io import read_safetensors
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question. " * 40)
    common = ["train", "--model", str(tiny_llama_folder(tmp_path / "config")), "--from-scratch", "--tokenizer",
              "byte", "--data", str(corpus), "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--no-progress",
              "--optim", "adamw_8bit", "--no-master-weights"]
    assert main([*common, "--out", str(tmp_path / "fp32")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--precision bf16" in err and "Traceback" not in err
    assert not (tmp_path / "fp32" / "checkpoints").exists()
    assert main([*common, "--out", str(tmp_path / "run"), "--precision", "bf16"]) == 0
    folder = tmp_path / "run" / "checkpoints" / "checkpoint-2"
    assert json.loads((folder / "trainer_state.json").read_text())["config"]["master_weights"] is False
    states = read_safetensors(folder / "optimizer.safetensors")
    assert not [k for k in states if k.endswith(".master")] and states["0.0.exp_avg"].array.dtype == np.uint8


def bf16(x):
    return dt.from_bfloat16(dt.to_bfloat16(np.asarray(x, F32)))


@pytest.mark.parametrize("grad_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16", "int8"])
def test_bfloat16_weights_without_masters_match_the_numpy_reference(state_dtype, grad_dtype):
    """master_weights=False: a bfloat16 parameter is updated in place, the update computed in float32 from the
    widened weight and rounded to nearest even, as torch.optim.AdamW and bitsandbytes update bfloat16 weights. The
    moments are bit for bit the reference's (they do not depend on the weights); the weights within one bfloat16
    step of it (a GPU's division may round the update differently) and mostly equal."""
    rng = np.random.default_rng(5)
    size, block = 3072, 256
    p0 = bf16(rng.standard_normal(size))
    grads = [(rng.standard_normal(size) * 10.0 ** rng.uniform(-1, 0, size)).astype(F32) for _ in range(4)]
    if grad_dtype == "bfloat16":
        grads = [bf16(g) for g in grads]
    p = vkf.parameter(p0, dtype="bfloat16")
    opt = AdamW([p], **HP, state_dtype=state_dtype, min_8bit_size=0, master_weights=False)
    for g in grads:
        p.grad = vkf.tensor(g, dtype=grad_dtype)
        opt.step()
        opt.zero_grad()
        p.numpy()
    state = opt.state[id(p)]
    assert state["master"] is None and p.dtype is dt.bfloat16
    ref_p, m, v = p0, np.zeros(size, F32), np.zeros(size, F32)
    for step, g in enumerate(grads, 1):
        new_p, m, v = adam_float32(ref_p, g, m, v, step)
        ref_p = bf16(new_p)
        if state_dtype == "bfloat16":
            m, v = bf16(m), bf16(v)
        elif state_dtype == "int8":  # blocks of 256: quantized to the maps, scaled by each block's absmax
            absmax_m, absmax_v = np.abs(m).reshape(-1, block).max(1), v.reshape(-1, block).max(1)
            codes_m = np.concatenate([quantize(x, a, SIGNED) for x, a in zip(m.reshape(-1, block), absmax_m)])
            codes_v = np.concatenate([quantize(x, a, UNSIGNED) for x, a in zip(v.reshape(-1, block), absmax_v)])
            m, v = SIGNED[codes_m] * np.repeat(absmax_m, block), UNSIGNED[codes_v] * np.repeat(absmax_v, block)
    if state_dtype == "int8":
        np.testing.assert_array_equal(state["exp_avg"].numpy(), codes_m)
        np.testing.assert_array_equal(state["exp_avg_sq"].numpy(), codes_v)
    else:
        np.testing.assert_array_equal(state["exp_avg"].numpy(), m)
        np.testing.assert_array_equal(state["exp_avg_sq"].numpy(), v)
    got = p.numpy()
    step = np.abs(ref_p) * 2.0 ** -7  # a bfloat16 step (8 significant bits) at the weight's magnitude
    assert np.all(np.abs(got - ref_p) <= step), np.abs(got - ref_p).max()
    assert np.mean(got == ref_p) > 0.99


def test_masters_can_be_turned_off_for_bfloat16_only():
    weights = vkf.parameter(np.ones(8, F32), dtype="bfloat16")
    opt = AdamW([weights], master_weights=False)
    opt.init_state()
    assert opt.state[id(weights)]["master"] is None and not opt.keeps_master(weights)
    kept = AdamW([weights])
    kept.init_state()
    assert kept.state[id(weights)]["master"].dtype is dt.float32
    with pytest.raises(OptimizerConfigError, match="float16 ones need float32 masters"):
        AdamW([vkf.parameter(np.ones(8, F32), dtype="float16")], master_weights=False)


def bf16_trainer(out, master_weights, steps=6, save_every=0, model_seed=0):
    config = TrainingConfig(steps=steps, batch_size=4, seq_len=16, lr=1e-2, warmup=2, schedule="cosine",
                            save_every=save_every, seed=3, weight_decay=0.01, optim="adamw_8bit", precision="bf16",
                            master_weights=master_weights)
    model = tiny_model(seed=model_seed, dtype="bfloat16", dropout=0.1)
    return Trainer(model, config, Batches(tiny_data(), 4, seed=3), out_dir=out)


def test_bf16_training_without_master_weights_resumes_exactly(tmp_path):
    """--precision bf16 --no-master-weights: the loss falls, no parameter has a float32 master, and a resumed run
    repeats the same losses and states; a run with master weights refuses that checkpoint."""
    from vkformers.training.checkpoint import CheckpointLoadError
    full = bf16_trainer(tmp_path / "a", False, save_every=3)
    reference = [r["loss"] for r in full.train()]
    assert reference[-1] < reference[0] - 0.5
    assert all(st["master"] is None for st in full.optimizer.state.values())
    assert all(p.dtype is dt.bfloat16 for p in full.params)
    resumed = bf16_trainer(tmp_path / "b", False, model_seed=99)
    resumed.resume(tmp_path / "a" / "checkpoints" / "checkpoint-3")
    assert [r["loss"] for r in resumed.train()] == reference[3:]
    for key, array in full.optimizer.state_dict().items():
        np.testing.assert_array_equal(resumed.optimizer.state_dict()[key], array, err_msg=key)
    with pytest.raises(CheckpointLoadError, match="master_weights"):
        bf16_trainer(tmp_path / "c", True).resume(tmp_path / "a" / "checkpoints" / "checkpoint-3")


def test_no_master_weights_needs_bf16(tmp_path):
    from vkformers.training.trainer import TrainingConfigError
    with pytest.raises(TrainingConfigError, match="--precision bf16"):
        TrainingConfig(master_weights=False)
    with pytest.raises(TrainingConfigError, match="--precision bf16"):
        TrainingConfig(master_weights=False, precision="fp16")
