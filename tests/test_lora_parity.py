"""LoRA against PEFT on transformers: tests/fixtures/llama_lora (tools/make_fixtures.py, build_lora).

The fixture is an adapter PEFT saved (r 4, alpha 8, q_proj and v_proj, lora_B non-zero so it changes
the logits) for the llama fixture's model, and PEFT's outputs with it on the llama fixture's batch.
vkformers loads the base model plus that adapter and must give PEFT's logits (1e-4 absolute), loss
(1e-5 relative), LoRA gradients (1e-3 relative to each tensor's largest element) and LoRA parameters
after one AdamW step (lr 1e-2, betas (0.9, 0.999), eps 1e-8, weight decay 0.01; 1e-5 absolute); and
save_adapter must write what PEFT wrote: the same tensor names, shapes and bytes, and the same config.
"""
import json

import numpy as np
import pytest

from fixture_cases import read_reference
from test_decoder_parity import FIXTURES
from vkformers.engine.tensor import parameter, tensor
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.models.safetensors_io import read_safetensors
from vkformers.optim import AdamW
from vkformers.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_adapter, save_adapter, trainable_parameters

ADAPTER = FIXTURES / "llama_lora"
pytestmark = pytest.mark.skipif(not (ADAPTER / ADAPTER_WEIGHTS).is_file(), reason="no llama_lora fixture")


@pytest.fixture(scope="module")
def case():
    meta = json.loads((ADAPTER / "meta.json").read_text())
    reference = read_reference(ADAPTER / "lora_reference.safetensors")
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / meta["base_fixture"], dtype="float32")
    load_adapter(model, ADAPTER, trainable=True)
    ids, mask, labels = (reference[k].astype(np.int32) for k in ("input_ids", "attention_mask", "labels"))
    out = model(ids, attention_mask=mask, labels=labels)
    logits, loss = out.logits.numpy(), out.loss.item()
    out.loss.backward()
    params = dict(trainable_parameters(model))
    grads = {n: p.grad.numpy() for n, p in params.items()}
    return dict(meta=meta, ref=reference, model=model, mask=mask, logits=logits, loss=loss, params=params,
                grads=grads)


def test_lora_parameters_are_the_adapters(case):
    assert sorted(case["params"]) == sorted(case["meta"]["lora_parameters"])


def test_logits_and_loss(case):
    real = case["mask"].astype(bool)  # padded query rows see no key: defined differently, not compared
    error = np.abs(case["logits"] - case["ref"]["logits"])[real].max()
    assert error <= 1e-4, f"logits differ by {error:.3g}"
    base = AutoModelForCausalLM.from_pretrained(FIXTURES / case["meta"]["base_fixture"], dtype="float32")
    effect = np.abs(base(case["ref"]["input_ids"].astype(np.int32), attention_mask=case["mask"]).logits.numpy()
                    - case["logits"])[real].max()
    assert effect > 0.1, "the adapter should change the logits (lora_B is non-zero in the fixture)"
    ref_loss = float(case["ref"]["loss"])
    assert abs(case["loss"] - ref_loss) <= 1e-5 * abs(ref_loss)


def test_lora_gradients(case):
    failures = []
    for name, grad in sorted(case["grads"].items()):
        expected = case["ref"][f"grad.{name}"]
        error, bound = np.abs(grad - expected).max(), 1e-3 * np.abs(expected).max()
        if not error <= bound:
            failures.append(f"{name}: {error:.3g} > {bound:.3g}")
    assert not failures, "; ".join(failures)


def test_one_adamw_step_on_the_adapters(case):
    params = case["params"]
    # copies: the step updates in place and the other tests share the model
    copies = {n: parameter(p.numpy()) for n, p in params.items()}
    for n, p in copies.items():
        p.grad = tensor(case["grads"][n])
    AdamW(list(copies.values()), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01).step()
    for name, p in sorted(copies.items()):
        np.testing.assert_allclose(p.numpy(), case["ref"][f"adamw.{name}"], atol=1e-5, rtol=0, err_msg=name)


def test_save_adapter_writes_what_peft_wrote(case, tmp_path):
    save_adapter(case["model"], tmp_path)
    theirs = read_safetensors(ADAPTER / ADAPTER_WEIGHTS)
    ours = read_safetensors(tmp_path / ADAPTER_WEIGHTS)
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert (ours[key].code, ours[key].array.shape) == (theirs[key].code, theirs[key].array.shape), key
        # the model was loaded from these tensors and not updated since: bit-identical
        assert ours[key].array.tobytes() == theirs[key].array.tobytes(), key
    peft_config = json.loads((ADAPTER / ADAPTER_CONFIG).read_text())
    our_config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    assert set(our_config) == set(peft_config), (f"only ours: {sorted(set(our_config) - set(peft_config))}, "
                                                 f"only PEFT's: {sorted(set(peft_config) - set(our_config))}")
    differing = {k: (our_config[k], peft_config[k]) for k in peft_config if our_config[k] != peft_config[k]}
    assert not differing, f"config fields that differ (ours, PEFT's): {differing}"


def test_a_new_adapter_config_agrees_with_peft(tmp_path):
    """A fresh apply_lora writes a subset of PEFT's fields (PEFT fills the others with defaults), same values."""
    from vkformers.models.lora import LoraConfig, apply_lora
    meta = json.loads((ADAPTER / "meta.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / meta["base_fixture"], dtype="float32")
    apply_lora(model, LoraConfig(**meta["lora_config"]))
    save_adapter(model, tmp_path)
    peft_config = json.loads((ADAPTER / ADAPTER_CONFIG).read_text())
    our_config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    assert set(our_config) <= set(peft_config), sorted(set(our_config) - set(peft_config))
    differing = {k: (v, peft_config[k]) for k, v in our_config.items()
                 if v != peft_config[k] and k != "base_model_name_or_path"}
    assert not differing, f"(ours, PEFT's): {differing}"
    assert sorted(read_safetensors(tmp_path / ADAPTER_WEIGHTS)) == sorted(read_safetensors(ADAPTER / ADAPTER_WEIGHTS))
