"""Forwards submitted in parts: a long prompt's forward built in Python is submitted every few layers without
waiting (Module.layer_parts, Tensor.realize(wait=False)), so the host builds the next layers while the device runs the
last ones. The results must be bit-identical to one realization, with padding and a KV cache, and the runtime must
keep every submit's buffers alive and ordered until it ends."""
from pathlib import Path

import numpy as np
import pytest

import vkformers as vkf
from vkformers.engine import lazy
from vkformers.engine.tensor import Tensor
from vkformers.models import module
from vkformers.models.cache import KVCache
from vkformers.models.loading import AutoModelForCausalLM, AutoModelForMaskedLM
from vkformers.runtime import vulkan

CONFIG = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
              num_hidden_layers=16)


@pytest.fixture(scope="module")
def model():
    m = AutoModelForCausalLM.from_config(CONFIG)
    rng = np.random.default_rng(0)
    m.load_state_dict({n: rng.standard_normal(s.shape).astype(np.float32) * 0.1
                       for n, s in m.named_slots() if s.tied_to is None}, dtype="float32", requires_grad=False)
    return m.eval()


@pytest.fixture
def submits(monkeypatch):
    """Counts Sequence.submit calls."""
    count = [0]
    original = vulkan.Sequence.submit

    def submit(seq):
        count[0] += 1
        return original(seq)
    monkeypatch.setattr(vulkan.Sequence, "submit", submit)
    return count


def whole(monkeypatch):
    monkeypatch.setattr(module, "SUBMIT_MIN_TOKENS", 1 << 30)


def padded_batch(length=160):
    ids = np.random.default_rng(1).integers(0, 256, (2, length)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :37] = 0  # left padding
    return ids, mask


def test_layer_parts_follow_tokens_layers_and_workspace(model, monkeypatch):
    monkeypatch.setattr(module, "SUBMIT_MIN_LAYERS", 4)
    x = lambda rows, tokens, dtype="float32": Tensor(np.zeros((rows, tokens, 64), np.float32), dtype=dtype)  # noqa
    assert model.layer_parts(x(1, module.SUBMIT_MIN_TOKENS - 1), 16) == 1  # too short: the device's share is small
    assert model.layer_parts(x(1, module.SUBMIT_MIN_TOKENS), 16) == 4
    assert model.layer_parts(x(2, 100), 32) == 8  # rows count: 200 tokens
    assert model.layer_parts(x(1, 200), 15) == 3  # parts of at least SUBMIT_MIN_LAYERS
    assert model.layer_parts(x(1, 200), 7) == 1
    # the added workspace is bounded: 16 x tokens x hidden x 4 bytes a part
    tokens = module.SUBMIT_WORKSPACE_BYTES // (16 * 64 * 4) // 2
    assert model.layer_parts(x(1, tokens), 64) == 3
    assert model.layer_parts(Tensor(np.zeros((1, 200, 64), np.float32), requires_grad=True), 32) == 1
    assert model.layer_parts(x(200, 64)[0], 32) == 1  # not a [batch, tokens, hidden] stream


def submits_of(model, rows: int, tokens: int) -> int:
    """Submits without waiting of one forward of rows x tokens through the 16-layer model: one less than its parts."""
    parts = model.layer_parts(Tensor(np.zeros((rows, tokens, 64), np.float32)), CONFIG["num_hidden_layers"])
    assert parts > 1
    return parts - 1


def test_forward_in_parts_is_bit_identical_with_padding(model, submits, monkeypatch):
    ids, mask = padded_batch()
    expected = 3 * submits_of(model, *ids.shape)
    with vkf.no_grad():
        parts = [model(ids, attention_mask=mask).logits.numpy() for _ in range(3)]  # recorded, then replayed
        assert submits[0] == expected
        whole(monkeypatch)
        one = model(ids, attention_mask=mask).logits.numpy()
    assert submits[0] == expected
    for logits in parts:
        np.testing.assert_array_equal(logits, one)


def prompt_then_step(model, ids, mask):
    """The logits of a forward of ``ids`` into a KV cache, then of one more token per row read from that cache."""
    rows, length = ids.shape
    cache = KVCache(CONFIG["num_hidden_layers"], rows, 2, 16, length + 1, "float32")
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    prompt = model(ids, attention_mask=mask, position_ids=positions, cache=cache).logits.numpy()
    step_ids = np.array([[5], [7]], np.int32)
    step_mask = np.concatenate([mask, np.ones((rows, 1), mask.dtype)], axis=1)
    step = model(step_ids, attention_mask=step_mask, position_ids=positions[:, -1:] + 1, cache=cache).logits.numpy()
    return prompt, step


def test_a_prompt_in_parts_fills_the_kv_cache_as_one_forward(model, submits, monkeypatch):
    ids, mask = padded_batch(140)
    with vkf.no_grad():
        split = prompt_then_step(model, ids, mask)
        assert submits[0] == submits_of(model, *ids.shape)  # the prompt's forward; one token's is never split
        whole(monkeypatch)
        one = prompt_then_step(model, ids, mask)
    np.testing.assert_array_equal(split[0], one[0])
    np.testing.assert_array_equal(split[1], one[1])


def test_generate_prompts_stay_one_submission(model, submits):
    """generate's prefill is observed by a capture (replayed from the third prompt of its shape), which needs one
    submission: it is never split."""
    ids, mask = padded_batch(140)
    with vkf.no_grad():
        tokens = [np.asarray(model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False))
                  for _ in range(3)]
    assert submits[0] == 0
    np.testing.assert_array_equal(tokens[0], tokens[2])


def test_training_and_captured_forwards_stay_one_submission(model, submits):
    ids, _ = padded_batch()
    trained = AutoModelForCausalLM.from_config(CONFIG)
    trained.load_state_dict({n: np.full(s.shape, 0.01, np.float32) for n, s in trained.named_slots()
                             if s.tied_to is None}, dtype="float32")
    loss = trained(ids, labels=ids).loss
    loss.backward()
    assert np.isfinite(loss.item())
    assert submits[0] == 0  # a backward needs the graph whole
    step = lazy.StepCapture()
    with vkf.no_grad():
        first = [step.run(lambda: [model(ids).logits[:, -1]], {"ids": ids})[0] for _ in range(3)]
    assert step.ready and submits[0] == 0  # a capture must see one submission to replay it
    np.testing.assert_array_equal(first[0], first[2])


def test_a_submitted_plan_evicted_from_the_cache_still_runs(model, submits, monkeypatch):
    ids, mask = padded_batch()
    with vkf.no_grad():
        expected = model(ids, attention_mask=mask).logits.numpy()
        monkeypatch.setattr(lazy, "MAX_PLANS", 1)  # every part's plan is evicted as the next is recorded
        lazy.clear_plan_cache()  # recorded again, each part evicting the one before while it runs
        got = model(ids, attention_mask=mask).logits.numpy()
    np.testing.assert_array_equal(got, expected)
    assert submits[0] == 2 * submits_of(model, *ids.shape)


def test_a_later_replay_waits_for_every_submit(device):
    n = 1 << 16
    axpby = device.kernel("axpby", "u32")
    x, y = device.upload(np.full(n, 3, np.uint32)), device.upload(np.zeros(n, np.uint32))
    first = device.sequence().dispatch(axpby, [x, y], (n // 256,), [n, 1, 1]).submit()
    second = device.sequence().dispatch(axpby, [x, y], (n // 256,), [n, 1, 1]).submit()
    assert first.in_flight and second.in_flight
    first.submit()  # again while in flight: waits for its last submit first
    z = device.upload(np.zeros(4, np.uint32))
    device.sequence().copy(z, device.upload(np.zeros(4, np.uint32))).replay()
    assert not first.in_flight and not second.in_flight
    assert (y.read() == 9).all()  # three submits of y += x, in order


FIXTURES = Path(__file__).parent / "fixtures"
# every shared layer loop that submits in parts: the decoder kit's (dense, sliding and soft-capped, ALiBi, MLA, MoE,
# hybrids of linear attention and of Mamba), the hyper-connection streams of vkformers_moe, Mamba's, BERT's
FAMILIES = ["llama", "gemma2", "bloom", "deepseek_v3", "mixtral", "qwen3_next", "qwen4_exp_text", "jamba", "bamba",
            "mamba", "encoders/bert", "encoders/deberta-v2"]


@pytest.mark.parametrize("name", FAMILIES)
def test_each_layer_loop_in_parts_is_bit_identical(name, submits, monkeypatch):
    """Two-layer fixtures split after every layer: the stream handed from part to part is all a layer passes on."""
    folder = FIXTURES / name
    loader = AutoModelForMaskedLM if name.startswith("encoders/") else AutoModelForCausalLM
    model = loader.from_pretrained(folder, dtype="float32", requires_grad=False)
    vocab = int(model.config["vocab_size"])
    ids = np.random.default_rng(2).integers(3, vocab, (2, 12)).astype(np.int32)
    mask = np.ones_like(ids)
    if loader is AutoModelForCausalLM:
        mask[1, :3] = 0  # left padding
    else:
        mask[1, -3:] = 0
    monkeypatch.setattr(module, "SUBMIT_MIN_TOKENS", 1)
    monkeypatch.setattr(module, "SUBMIT_MIN_LAYERS", 1)
    with vkf.no_grad():
        split = model(ids, attention_mask=mask).logits.numpy()
        assert submits[0] >= 1
        whole(monkeypatch)
        one = model(ids, attention_mask=mask).logits.numpy()
    np.testing.assert_array_equal(split, one)
