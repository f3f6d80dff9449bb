"""Weights larger than one device buffer (engine/row_blocks.py): held as blocks of rows, they give the numbers the
whole weight gives.

Most tests lower ``row_blocks.BLOCK_BYTES`` so that a tiny Llama's embedding and LM head (320 x 64) split into three
blocks, and compare with the same model whole in one process: logits of a padded batch and greedy tokens
(bit-identical: every output element is the same lookup or the same product), also after a dtype conversion and a
resize; training (gradients within 1e-5 of each tensor's largest, AdamW steps' losses within 1e-5); an interrupted
run resumed from its checkpoint (bit-identical to the run without the break); saving (whole tensors under their HF
names); a ``padding_idx`` row in a later block; packed Q8_0 blocks. One test splits at the device's own limit
where it is under the weight (lavapipe binds 128 MiB).
"""
import numpy as np
import pytest

from vkformers.engine import functional as F
from vkformers.engine import row_blocks
from vkformers.engine.row_blocks import RowBlocks, row_spans
from vkformers.engine.tensor import Tensor, weight_parameter
from vkformers.errors import RowBlocksError, VkformersError
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.runtime.vulkan import get_device
from vkformers.training import Batches, ByteTokenizer, Trainer, TrainingConfig
from vkformers.training.data import PackedDataset, Record, tokenize_records

from test_gguf import CONFIG, random_llama

VOCAB = 320
SPLIT_BYTES = 30_000  # 320 x 64 float32 rows (81,920 bytes) -> 3 blocks of 107, 107 and 106 rows


@pytest.fixture
def split_weights(monkeypatch):
    monkeypatch.setattr(row_blocks, "BLOCK_BYTES", SPLIT_BYTES)


def llama(arrays, tied, dtype="float32"):
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB,
              "tie_word_embeddings": tied, **CONFIG}
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(arrays, dtype=dtype)
    return model


def whole_and_split(monkeypatch, tied, dtype="float32"):
    arrays = random_llama(VOCAB, seed=3, tied=tied)
    whole = llama(arrays, tied, dtype)
    monkeypatch.setattr(row_blocks, "BLOCK_BYTES", SPLIT_BYTES)
    split = llama(arrays, tied, dtype)
    monkeypatch.setattr(row_blocks, "BLOCK_BYTES", None)
    params = dict(split.named_parameters())
    for name in ["model.embed_tokens.weight"] + ([] if tied else ["lm_head.weight"]):
        assert isinstance(params[name], RowBlocks) and len(params[name].parts) == 3, name
    assert not isinstance(params["model.layers.0.mlp.up_proj.weight"], RowBlocks)
    return whole, split


def test_row_spans_are_as_few_equal_blocks_as_fit():
    device = get_device()
    limit = row_blocks.block_bytes(device)
    assert row_spans(10, limit // 10, device) == [(0, 10)]
    assert row_spans(10, limit // 4, device) == [(0, 4), (4, 8), (8, 10)]
    assert row_spans(320, 256, device) == [(0, 320)] or limit < 320 * 256
    with pytest.raises(VkformersError, match="larger maxStorageBufferRange"):
        row_spans(2, limit + 1, device)


@pytest.mark.parametrize("tied", [True, False])
def test_a_split_model_gives_the_whole_models_logits_and_tokens(monkeypatch, tied):
    whole, split = whole_and_split(monkeypatch, tied)
    ids = np.array([[5, 200, 319, 17, 108, 107], [0, 0, 213, 214, 106, 9]], np.int32)  # ids around the blocks' edges
    mask = np.array([[1] * 6, [0, 0, 1, 1, 1, 1]], np.int32)
    np.testing.assert_array_equal(split(ids, attention_mask=mask).logits.numpy(),
                                  whole(ids, attention_mask=mask).logits.numpy())
    np.testing.assert_array_equal(split.generate(ids[:1], max_new_tokens=8, do_sample=False),
                                  whole.generate(ids[:1], max_new_tokens=8, do_sample=False))


def test_dtype_conversion_and_resizing_keep_the_blocks(monkeypatch):
    whole, split = whole_and_split(monkeypatch, tied=True)
    whole.bfloat16().resize_token_embeddings(330)
    monkeypatch.setattr(row_blocks, "BLOCK_BYTES", SPLIT_BYTES)
    split.bfloat16().resize_token_embeddings(330)
    table = dict(split.named_parameters())["model.embed_tokens.weight"]
    assert isinstance(table, RowBlocks) and table.shape == (330, 64) and table.dtype.name == "bfloat16"
    ids = np.array([[5, 200, 329, 17, 108, 107]], np.int32)
    np.testing.assert_array_equal(split(ids).logits.numpy(), whole(ids).logits.numpy())


def text_batches(seed):
    tokens, labels = tokenize_records([Record("The quick brown fox jumps over the lazy dog. " * 20)], ByteTokenizer())
    return Batches(PackedDataset(tokens, labels, 16), 2, seed=seed)


def train(model, steps, out_dir=None, resume=False):
    config = TrainingConfig(steps=steps, batch_size=2, seq_len=16, lr=1e-2, schedule="constant", save_every=1)
    trainer = Trainer(model.train(), config, text_batches(0), out_dir=out_dir)
    if resume:
        assert trainer.resume() is not None
    trainer.train()
    return trainer


def gradients(model, ids):
    model.train()(ids, labels=ids).loss.backward()
    return {name: np.concatenate([p.grad.numpy() for p in t.parts]) if isinstance(t, RowBlocks) else t.grad.numpy()
            for name, t in model.named_parameters()}


def test_every_block_trains_as_the_whole_weight_does(monkeypatch):
    """Gradients within 1e-5 of each tensor's largest (the input's gradient adds the blocks' products apart), and
    three AdamW steps' losses within 1e-5."""
    whole, split = whole_and_split(monkeypatch, tied=False)
    ids = np.array([[5, 200, 319, 17, 108, 107, 213, 214]], np.int32)
    want, got = gradients(whole, ids), gradients(split, ids)
    for name, value in want.items():
        assert np.abs(got[name] - value).max() <= 1e-5 * np.abs(value).max(), name
    a, b = train(whole, 3), train(split, 3)
    assert len(b.params) == len(a.params) + 4  # two weights of three blocks each
    losses = [[h["loss"] for h in t.history if "loss" in h] for t in (a, b)]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)


def test_a_split_run_resumes_exactly_and_saves_whole_tensors(monkeypatch, split_weights, tmp_path):
    arrays = random_llama(VOCAB, seed=4, tied=True)
    straight = llama(arrays, tied=True)
    train(straight, 4)
    interrupted = llama(arrays, tied=True)
    train(interrupted, 2, out_dir=tmp_path / "run")
    resumed = llama(arrays, tied=True)
    train(resumed, 4, out_dir=tmp_path / "run", resume=True)
    for name, value in straight.state_dict().items():
        np.testing.assert_array_equal(resumed.state_dict()[name], value, err_msg=name)
    resumed.save_pretrained(tmp_path / "saved")
    monkeypatch.setattr(row_blocks, "BLOCK_BYTES", None)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    embedding = dict(loaded.named_parameters())["model.embed_tokens.weight"]
    assert not isinstance(embedding, RowBlocks) and embedding.shape == (VOCAB, CONFIG["hidden_size"])
    np.testing.assert_array_equal(embedding.numpy(), straight.state_dict()["model.embed_tokens.weight"])


def test_a_padding_row_in_a_later_block_gets_no_gradient(monkeypatch):
    table = np.random.default_rng(5).standard_normal((VOCAB, 64)).astype(np.float32)
    ids = Tensor(np.array([[3, 250, 108, 250, 319]], np.int32))
    weights = np.random.default_rng(6).standard_normal((1, 5, 64)).astype(np.float32)
    grads = []
    for limit in (None, SPLIT_BYTES):
        monkeypatch.setattr(row_blocks, "BLOCK_BYTES", limit)
        weight = weight_parameter(table, name="table")
        out = F.embedding(ids, weight, padding_idx=250 - VOCAB)  # counted from the end, as torch does
        np.testing.assert_array_equal(out.numpy(), table[ids.numpy()])
        (out * Tensor(weights)).sum().backward()
        parts = weight.parts if isinstance(weight, RowBlocks) else [weight]
        grads.append(np.concatenate([p.grad.numpy() for p in parts]))
    assert isinstance(weight, RowBlocks)
    with pytest.raises(RowBlocksError, match=r"3 blocks of rows.*not \.transpose"):
        weight.transpose(0, 1)
    np.testing.assert_array_equal(grads[1], grads[0])
    assert not grads[1][250].any() and grads[1][319].any()


def test_packed_blocks_split_too(monkeypatch, tmp_path):
    pytest.importorskip("gguf", reason="the gguf extra writes the file")
    from test_gguf import train_bpe, write_tiny_gguf
    backend = train_bpe()
    path = write_tiny_gguf(tmp_path / "tiny.gguf", random_llama(backend.get_vocab_size(), seed=7), backend,
                           quant="Q8_0")
    whole = AutoModelForCausalLM.from_pretrained(path)
    monkeypatch.setattr(row_blocks, "BLOCK_BYTES", 8_000)  # Q8_0 rows of 64 values take 68 bytes
    split = AutoModelForCausalLM.from_pretrained(path)
    table = dict(split.named_parameters())["model.embed_tokens.weight"]
    assert isinstance(table, RowBlocks) and table.quantized and len(table.parts) == 3
    assert table.format.name == "q8_0"
    np.testing.assert_array_equal(table.packed_numpy(), dict(whole.named_parameters())[
        "model.embed_tokens.weight"].packed_numpy())
    ids = np.array([[1, 150, 300, 7]], np.int32)
    np.testing.assert_array_equal(split(ids).logits.numpy(), whole(ids).logits.numpy())


def test_a_table_over_the_devices_own_limit_loads_and_runs(monkeypatch):
    vocab, hidden = 70_000, 512  # float32: 143 MB, over lavapipe's 128 MiB
    device = get_device()
    if device.max_buffer_bytes >= vocab * hidden * 4:
        monkeypatch.setattr(row_blocks, "BLOCK_BYTES", 64 << 20)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 1, "max_position_embeddings": 64, "tie_word_embeddings": True}
    model = AutoModelForCausalLM.from_config(config)
    rng = np.random.default_rng(8)
    arrays = {name: (np.ones(slot.shape, np.float32) if len(slot.shape) == 1 else
                     (0.02 * rng.standard_normal(slot.shape)).astype(np.float32))
              for name, slot in model.named_slots() if slot.tied_to is None}
    model.load_state_dict(arrays)
    table = arrays["model.embed_tokens.weight"]
    weight = dict(model.named_parameters())["model.embed_tokens.weight"]
    assert isinstance(weight, RowBlocks)
    ids = np.array([[1, 35_000, 69_999]], np.int32)
    np.testing.assert_array_equal(F.embedding(Tensor(ids), weight).numpy(), table[ids])
    hidden = rng.standard_normal((3, hidden)).astype(np.float32)
    want = hidden.astype(np.float64) @ table.T.astype(np.float64)
    assert np.abs(F.linear(Tensor(hidden), weight).numpy() - want).max() <= 1e-5 * np.abs(want).max()
    tokens = model.generate(ids, max_new_tokens=2, do_sample=False)
    assert tokens.shape == (1, 5) and (tokens < vocab).all()
