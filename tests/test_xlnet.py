"""XLNet beyond its decoder fixture (tests/test_decoder_parity.py and the others run tests/fixtures/xlnet: the content
stream, generate): the query stream with perm_mask, target_mapping and token types as the pretraining loss uses them,
and mems (tools/make_xlnet_references.py). Tolerances as test_decoder_parity's: logits 1e-4 absolute, loss 1e-5
relative, each gradient 1e-3 of its largest magnitude (floored at 1e-3 of the model's largest)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from vkformers.errors import InputError, VkformersError
from vkformers.models.decoder import UnsupportedConfigError
from vkformers.models.loading import AutoModelForCausalLM, load_config
from vkformers.models.safetensors_io import read_safetensors
from vkformers.training.trainer import Trainer, TrainingConfig
from vkformers_llama.variants import xlnet

FIXTURES = Path(__file__).parent / "fixtures" / "xlnet"


def _reference() -> dict:
    return {k: e.as_float() for k, e in read_safetensors(FIXTURES / "streams.safetensors").items()}


def _model():
    return AutoModelForCausalLM.from_pretrained(FIXTURES, dtype="float32")


def test_two_stream_loss_and_every_gradient():
    ref, model = _reference(), _model()
    case = {k[len("two_stream."):]: v for k, v in ref.items() if k.startswith("two_stream.")}
    out = model(case["input_ids"].astype(np.int32), attention_mask=case["attention_mask"].astype(np.int32),
                token_type_ids=case["token_type_ids"].astype(np.int32), perm_mask=case["perm_mask"],
                target_mapping=case["target_mapping"], labels=case["labels"].astype(np.int32))
    np.testing.assert_allclose(out.logits.numpy(), case["logits"], atol=1e-4, rtol=0)
    assert abs(out.loss.item() - float(case["loss"])) <= 1e-5 * abs(float(case["loss"]))
    out.loss.backward()
    grads = {k[len("grad."):]: v for k, v in case.items() if k.startswith("grad.")}
    params = dict(model.named_parameters())
    assert set(grads) == set(params)
    floor = 1e-3 * max(np.abs(g).max() for g in grads.values())
    for name, want in grads.items():
        got = params[name].grad
        assert got is not None, f"{name}: no gradient"
        bound = 1e-3 * max(np.abs(want).max(), floor)
        assert np.abs(got.numpy() - want).max() <= bound, name


def test_mems_continue_a_sequence():
    ref, model = _reference(), _model()
    ids = read_safetensors(FIXTURES / "reference.safetensors")["input_ids"].as_float().astype(np.int32)
    split = ids.shape[1] - ref["mems.logits"].shape[1]
    first = model(ids[:, :split], use_mems=True)
    second = model(ids[:, split:], token_type_ids=ref["mems.token_type_ids"].astype(np.int32), mems=first.mems,
                   use_mems=True)
    np.testing.assert_allclose(second.logits.numpy(), ref["mems.logits"], atol=1e-4, rtol=0)
    for i, kept in enumerate(second.mems):
        np.testing.assert_allclose(kept.numpy(), ref[f"mems.new.{i}"], atol=1e-4, rtol=0, err_msg=f"layer {i}")


def test_unimplemented_options_are_refused_by_name():
    for option, value in (("attn_type", "uni"), ("bi_data", True), ("clamp_len", 4), ("same_length", True)):
        with pytest.raises(UnsupportedConfigError, match=option):
            xlnet(dict(load_config(FIXTURES), **{option: value}))


def test_bad_inputs_are_refused():
    model = _model()
    ids = np.array([[5, 6, 7]], np.int32)
    with pytest.raises(InputError, match="perm_mask"):
        model(ids, perm_mask=np.zeros((1, 2, 2), np.float32))
    with pytest.raises(InputError, match="temperature"):
        model.generate(ids, max_new_tokens=2, do_sample=True, temperature=0)
    with pytest.raises(InputError, match="labels"):
        model(ids, labels=np.array([[5, 6]], np.int32))
    with pytest.raises(InputError, match="mems"):
        model(ids, mems=[np.zeros((2, 3, 16), np.float32)] * 2)


def test_sampling_is_seeded_and_streamed():
    model = _model()
    prompt = read_safetensors(FIXTURES / "reference.safetensors")["input_ids"].as_float()[:1].astype(np.int64)
    streamed = []
    runs = [model.generate(prompt, max_new_tokens=5, do_sample=True, top_k=8, seed=3, eos_token_id=[],
                           streamer=streamed.append) for _ in range(2)]
    np.testing.assert_array_equal(runs[0], runs[1])
    assert runs[0].shape == (1, prompt.shape[1] + 5)
    np.testing.assert_array_equal(np.concatenate(streamed[:5]), runs[0][0, prompt.shape[1]:])


def test_the_trainer_refuses_its_unshifted_loss():
    with pytest.raises(VkformersError, match="labels"):
        Trainer(_model(), TrainingConfig(), [])
