"""An encoder-decoder's decoder run alone as a causal LM against transformers 5.24: ProphetNetForCausalLM
(tests/fixtures/seq2seq-decoders/prophetnet, tools/make_seq2seq_decoder_fixtures.py), loaded by AutoModelForCausalLM.

On a batch with a left-padded row: the logits, the n-gram loss and every gradient, and one AdamW step from the
reference gradients; an unpadded batch without a mask; the padded batch attending to padded encoder states; greedy
tokens with the cache from an unpadded prompt and from a batch with a left-padded one. Tolerances as
tests/test_seq2seq_parity.py's: logits 1e-4 absolute, loss 1e-5 relative, each gradient 1e-3 of its largest magnitude
(floored at 1e-3 of the model's largest), AdamW 1e-5 absolute.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import vkformers as vkf
from vkformers.engine.lazy import realize
from vkformers.engine.tensor import parameter
from vkformers.errors import InputError, VkformersError
from vkformers.models.loading import AutoModelForCausalLM, AutoModelForSeq2SeqLM
from vkformers.optim import AdamW

from fixture_cases import read_reference

FOLDER = Path(__file__).parent / "fixtures" / "seq2seq-decoders" / "prophetnet"
LOGITS_ATOL, LOSS_RTOL, GRAD_RTOL, ADAMW_ATOL = 1e-4, 1e-5, 1e-3, 1e-5


@pytest.fixture(scope="module")
def case():
    ref = read_reference(FOLDER / "reference.safetensors")
    meta = json.loads((FOLDER / "meta.json").read_text())
    return AutoModelForCausalLM.from_pretrained(FOLDER, dtype="float32"), ref, meta


def _ids(array):
    return array.astype(np.int64)


def test_padded_batch_logits_loss_and_every_gradient(case):
    model, ref, meta = case
    out = model(_ids(ref["input_ids"]), attention_mask=_ids(ref["attention_mask"]), labels=_ids(ref["labels"]))
    out.loss.backward()
    params = dict(model.named_parameters())
    realize([out.logits.lazy, out.loss.lazy] + [p.grad.lazy for p in params.values() if p.grad is not None])
    error = np.abs(out.logits.numpy() - ref["logits"]).max()
    assert error <= LOGITS_ATOL, f"logits differ by {error:.3g}"
    assert abs(out.loss.item() - float(ref["loss"])) <= LOSS_RTOL * abs(float(ref["loss"]))
    assert sorted(params) == sorted(meta["parameters"])
    grads = {k[len("grad."):]: v for k, v in ref.items() if k.startswith("grad.")}
    assert set(grads) | set(meta["params_without_grad"]) == set(params)
    largest = max(np.abs(g).max() for g in grads.values())
    for name, param in params.items():
        if name in meta["params_without_grad"]:  # the cross-attention, which no encoder states reach
            assert param.grad is None, f"{name}: a gradient where transformers has none"
            continue
        bound = GRAD_RTOL * max(np.abs(grads[name]).max(), 1e-3 * largest)
        error = np.abs(param.grad.numpy() - grads[name]).max()
        assert error <= bound, f"{name}: gradient differs by {error:.3g} > {bound:.3g}"
    for param in params.values():
        param.grad = None


def test_one_adamw_step(case):
    model, ref, meta = case
    params = {n: parameter(p.numpy(), dtype=p.dtype, name=n) for n, p in model.named_parameters()}
    for n, p in params.items():
        p.grad = None if n in meta["params_without_grad"] else vkf.tensor(ref[f"grad.{n}"])
    AdamW(list(params.values()), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01).step()
    realize([p.lazy for p in params.values()])
    for n, p in params.items():
        np.testing.assert_allclose(p.numpy(), ref[f"adamw.{n}"], atol=ADAMW_ATOL, rtol=0, err_msg=n)


def test_clean_batch_without_a_mask(case):
    model, ref, _ = case
    with vkf.no_grad():
        out = model(_ids(ref["clean.input_ids"]), labels=_ids(ref["clean.labels"]))
    assert np.abs(out.logits.numpy() - ref["clean.logits"]).max() <= LOGITS_ATOL
    assert abs(out.loss.item() - float(ref["clean.loss"])) <= LOSS_RTOL * abs(float(ref["clean.loss"]))


def test_cross_attention_over_padded_encoder_states(case):
    model, ref, _ = case
    with vkf.no_grad():
        out = model(_ids(ref["input_ids"]), attention_mask=_ids(ref["attention_mask"]),
                    encoder_hidden_states=vkf.tensor(ref["cross.encoder_hidden_states"]),
                    encoder_attention_mask=_ids(ref["cross.encoder_attention_mask"]))
    assert np.abs(out.logits.numpy() - ref["cross.logits"]).max() <= LOGITS_ATOL


@pytest.mark.parametrize("kind", ["greedy", "padded_greedy"])
def test_greedy_tokens_with_cache(case, kind, monkeypatch):
    """generate: the prompt fills the cache in one forward, then one token per step; the tokens are transformers'
    (test_prompt_then_steps_give_transformers_logits compares each step's logits)."""
    model, ref, _ = case
    ids = _ids(ref[f"{kind}.input_ids"])
    mask = _ids(ref[f"{kind}.attention_mask"]) if f"{kind}.attention_mask" in ref else None
    expected = ref[f"{kind}.tokens"].astype(np.int64)
    new = expected.shape[1] - ids.shape[1]
    steps, forward = [], model.forward

    def recording(input_ids, **kwargs):
        steps.append((np.asarray(input_ids).shape[1], kwargs["cache"].position))
        return forward(input_ids, **kwargs)
    monkeypatch.setattr(model, "forward", recording)
    tokens = model.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=[])
    assert tokens.tolist() == expected.tolist()
    assert steps == [(ids.shape[1], 0)] + [(1, ids.shape[1] + i) for i in range(new - 1)]


def test_prompt_then_steps_give_transformers_logits(case):
    """The logits of every greedy step: the prompt into an empty cache (every stream, its padding masked), then one
    token at a time (stream 0 over every stored key, padding included, as transformers' cached step)."""
    model, ref, _ = case
    for kind in ("greedy", "padded_greedy"):
        ids = _ids(ref[f"{kind}.input_ids"])
        mask = _ids(ref[f"{kind}.attention_mask"]) if f"{kind}.attention_mask" in ref else None
        tokens = ref[f"{kind}.tokens"].astype(np.int64)
        cache = model._generation_cache(ids.shape[0], tokens.shape[1])
        with vkf.no_grad():
            got = [model(ids, attention_mask=mask, cache=cache).logits.numpy()[:, -1]]
            for t in range(ids.shape[1], tokens.shape[1] - 1):
                got.append(model(tokens[:, t:t + 1], cache=cache).logits.numpy()[:, -1])
        error = np.abs(np.stack(got) - ref[f"{kind}.logits"]).max()
        assert error <= LOGITS_ATOL, f"{kind}: step logits differ by {error:.3g}"


def test_refusals(case):
    model, ref, _ = case
    ids = _ids(ref["input_ids"])
    with pytest.raises(InputError, match="position_ids"):
        model(ids, position_ids=np.arange(1, 9)[None])
    config = json.loads((FOLDER / "config.json").read_text())
    alone = AutoModelForCausalLM.from_config(dict(config, add_cross_attention=False))
    assert not any("cross_attn" in n for n, _ in alone.named_parameters())
    with pytest.raises(VkformersError, match="cross-attention"):
        alone(ids, encoder_hidden_states=vkf.tensor(ref["cross.encoder_hidden_states"]))
    with pytest.raises(VkformersError, match="add_cross_attention=False"):
        AutoModelForSeq2SeqLM.from_config(dict(config, add_cross_attention=False))
