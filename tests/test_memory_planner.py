"""The lazy engine's memory planner (lazy.MemoryPlan) and what it stands on.

- runtime: Buffer.alias (one storage seen in another dtype; barriers treat the two as one buffer) and
  Sequence.scratch (every workspace of a sequence over one allocation, the size of the largest);
- the planner: values that are never alive together share a slot across dtypes and sizes, elementwise ops and the
  cross-entropy backward write over an input that dies there, and results are bit-identical to the exact-match
  reuse it replaced (MEMORY_PLANNER = "exact"), for a graph mixing dtypes and for QLoRA training steps;
- a QLoRA step's peak device memory (the runtime's buffer accounting) on a small random Llama: below a stated
  bound and below the old planner's; frozen norm weights get no gradient kernel.
"""
import numpy as np
import pytest

import vkformers as vkf
from vkformers.engine import lazy
from vkformers.engine.tensor import Tensor
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.models.quantize import quantize_checkpoint
from vkformers.runtime import dtypes as dt
from vkformers.runtime import vulkan
from vkformers.training import LoraConfig, Trainer, TrainingConfig, apply_lora

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# hidden 128, ffn 384, vocab 4096: at batch 2 x 64 the bf16 logits (1 MiB) are the largest value, as at 8B
CONFIG = dict(model_type="llama", hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=4096, max_position_embeddings=256, rms_norm_eps=1e-5,
              tie_word_embeddings=False, hidden_act="silu")
BATCH, SEQ = 2, 64


@pytest.fixture
def planner(monkeypatch):
    """Set lazy.MEMORY_PLANNER for one run, on an empty plan cache (plans are cached whatever planned them)."""
    def use(name):
        lazy.clear_plan_cache()
        monkeypatch.setattr(lazy, "MEMORY_PLANNER", name)
    yield use
    lazy.clear_plan_cache()


# ---------------------------------------------------------------- runtime

def test_an_alias_reads_the_storage_in_its_own_dtype_and_orders_like_its_root():
    device = vulkan.get_device()
    values = np.arange(8, dtype=np.float32) - 2.5
    root = device.upload(values, name="root")
    words = root.alias(8, "uint32")
    np.testing.assert_array_equal(words.read(), values.view(np.uint32))
    half = root.alias(4, "float32")
    assert half.root is root and words.root is root and half.nbytes == 16
    with pytest.raises(ValueError, match="does not fit"):
        root.alias(9, "float32")
    # a write through the alias, then a read of the root: the sequence must put a barrier between them
    out = device.buffer(8, "float32")
    seq = device.sequence()
    seq.fill(words, 0x3F800000)  # 1.0f
    seq.copy(root, out)
    seq.replay()
    assert seq.num_barriers == 1
    np.testing.assert_array_equal(out.read(), np.ones(8, np.float32))
    assert [b is root for b in seq.buffers()].count(True) == 1 and len(seq.buffers()) == 2


def test_scratch_buffers_share_one_allocation_as_large_as_the_largest():
    device = vulkan.get_device()
    out_a, out_b = device.buffer(4, "float32"), device.buffer(16, "uint32")
    before = vulkan.buffer_memory()["live_bytes"]
    seq = device.sequence()
    a = seq.scratch(4, "float32", name="a")
    b = seq.scratch(16, "uint32", name="b")
    seq.fill(a, 0x40000000)  # 2.0f
    seq.copy(a, out_a)
    seq.fill(b, 7)
    seq.copy(b, out_b)
    seq.replay()
    assert a.root is b.root and a.root.nbytes == 64
    assert vulkan.buffer_memory()["live_bytes"] - before == 64
    np.testing.assert_array_equal(out_a.read(), np.full(4, 2.0, np.float32))
    np.testing.assert_array_equal(out_b.read(), np.full(16, 7, np.uint32))
    with pytest.raises(RuntimeError, match="already recorded"):
        seq.scratch(4)


# ---------------------------------------------------------------- the planner

def mixed_graph():
    """A chain through float32, bfloat16 and int32 values of several sizes, with in-place candidates."""
    rng = np.random.default_rng(0)
    x = vkf.tensor(rng.standard_normal((64, 96)).astype(np.float32))
    w = vkf.tensor(rng.standard_normal((96, 48)).astype(np.float32))
    h = (x * 2.0 + 1.0).exp().log()               # float32, elementwise: in place along the chain
    wide = (h @ (w * 0.5)).cast("bfloat16")        # [64, 48] bfloat16
    act = (wide.float().sigmoid() * wide.float()).cast("bfloat16") + wide
    ids = (act.float().abs() * 3.0).cast("int32")  # an int32 value
    outs = [act.float().sum(axis=1) + ids.float().sum(axis=1), act.float()]
    lazy.realize([t.lazy for t in outs])  # one plan
    return [t.numpy() for t in outs]


def test_planned_values_share_slots_across_dtypes_with_identical_results(planner):
    planner("exact")
    want = mixed_graph()
    exact = lazy.memory_report()
    planner("liveness")
    got = mixed_graph()
    report = lazy.memory_report()
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert report["in_place"] >= 4, report                     # the elementwise chains
    assert report["slots"] < report["values"] * 64 * 96 * 4    # shared: far less than a buffer per value
    assert report["peak_live"] <= report["slots"] <= 2 * report["peak_live"], report
    assert report["nbytes"] < exact["nbytes"], (report, exact)
    plan = next(reversed(lazy._plans.values()))
    roots = {}
    for buffers in plan.node_buffers:
        for b in buffers:
            roots.setdefault(id(b.root), set()).add(b.dtype.name)
    assert any(len(names) > 1 for names in roots.values()), "no slot held values of two dtypes"


def test_an_input_read_again_later_is_not_overwritten(planner):
    """h is read after both of its elementwise readers: neither may write over it."""
    def build(x):
        h = x + 0.5
        return (h.exp() + h * 3.0) * h

    x0 = np.linspace(-1, 1, 64, dtype=np.float32)
    results = []
    for name in ("exact", "liveness"):
        planner(name)
        out = build(vkf.tensor(x0))
        lazy.realize([out.lazy])
        results.append(out.numpy())
    np.testing.assert_array_equal(results[1], results[0])
    assert lazy.memory_report()["in_place"] == 1  # the sum over exp(h) (the product is the kept result), never h


# ---------------------------------------------------------------- a QLoRA step

def qlora_model():
    model = AutoModelForCausalLM.from_config(CONFIG)
    rng = np.random.default_rng(0)
    arrays = {name: np.ones(slot.shape, np.float32) if name.endswith("norm.weight")
              else rng.standard_normal(slot.shape).astype(np.float32) * 0.05
              for name, slot in model.named_slots() if slot.tied_to is None}
    model.load_state_dict(quantize_checkpoint(model, arrays, "nf4"), dtype="bfloat16", requires_grad=False)
    apply_lora(model, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS), seed=0)
    return model


def qlora_steps(steps=2):
    """Two QLoRA training steps (bf16, gradient checkpointing): losses, adapters after them, peak bytes of the
    first step beyond what was held before it, and the bytes the model and optimizer state hold."""
    model = qlora_model()
    trainer = Trainer(model, TrainingConfig(steps=steps, batch_size=BATCH, seq_len=SEQ, lr=1e-3,
                                            schedule="constant", precision="bf16", gradient_checkpointing=True),
                      train_batches=None)
    ids = np.random.default_rng(1).integers(0, CONFIG["vocab_size"], (BATCH, SEQ)).astype(np.int32)
    held = vulkan.buffer_memory()["live_bytes"]
    vulkan.reset_peak_buffer_memory()
    losses = [trainer.train_step([(ids, ids.copy())]).loss]
    peak = vulkan.buffer_memory()["peak_bytes"] - held
    report = lazy.memory_report()
    losses += [trainer.train_step([(ids, ids.copy())]).loss for _ in range(steps - 1)]
    adapters = {n: t.numpy() for n, t in model.named_parameters() if "lora_" in n}
    return losses, adapters, peak, report


def test_qlora_steps_are_bit_identical_and_peak_lower_than_with_exact_reuse(planner):
    planner("exact")
    want_losses, want_adapters, exact_peak, _ = qlora_steps()
    planner("liveness")
    losses, adapters, peak, report = qlora_steps()
    assert losses == want_losses
    for name, value in want_adapters.items():
        np.testing.assert_array_equal(adapters[name], value, err_msg=name)
    logits = BATCH * SEQ * CONFIG["vocab_size"] * 2  # bfloat16 logits: 1 MiB
    # The logits' gradient takes their buffer (cross-entropy in place) and no float32 copy of either exists; one
    # layer's recomputed activations and gradients are alive at a time (~1.4 MiB at most here). The bound: the
    # logits and twice as much again, for those and what the greedy slots waste. The exact-match reuse took 4.4 MiB.
    assert report["in_place"] >= 1 and report["peak_live"] <= 1.5 * logits, report
    # Scratch and kernel workspaces ("other") depend on the device's kernels (split-k partials, cooperative-matrix
    # attention), not on the planner, and are the same under both planners.
    values = peak - report["other"]
    assert values <= 3 * logits, (peak, report)
    assert values < 0.6 * (exact_peak - report["other"]), (peak, exact_peak, report)


def test_a_frozen_norm_weight_gets_no_gradient_kernel():
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((4, 32)).astype(np.float32), requires_grad=True)
    w = Tensor(rng.standard_normal(32).astype(np.float32))  # frozen
    with lazy.capture() as seen:
        vkf.functional.rms_norm(x, w, eps=1e-5).sum().backward()
        lazy.realize([x.grad.lazy])  # inside a capture backward() leaves the gradients lazy
    labels = [op.label for run in seen.runs for op in run.plan.seq._ops]
    assert any(label.startswith("norm.backward_dx") for label in labels)
    assert not any("param" in label for label in labels), labels  # backward_param / reduce_param: dweight
    assert x.grad is not None and w.grad is None
    assert dt.float32 is x.grad.dtype
