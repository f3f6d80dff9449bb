"""LoRA against PEFT on transformers: tests/fixtures/llama_lora (tools/make_fixtures.py, build_lora).

The fixture is an adapter PEFT saved (r 4, alpha 8, q_proj and v_proj, lora_B non-zero so it changes
the logits) for the llama fixture's model, and PEFT's outputs with it on the llama fixture's batch.
vkformers loads the base model plus that adapter and must give PEFT's logits (1e-4 absolute), loss
(1e-5 relative), LoRA gradients (1e-3 relative to each tensor's largest element) and LoRA parameters
after one AdamW step (lr 1e-2, betas (0.9, 0.999), eps 1e-8, weight decay 0.01; 1e-5 absolute); and
save_adapter must write what PEFT wrote: the same tensor names, shapes and bytes, and the same config. The same
adapter torch.save'd as adapter_model.bin (PEFT < 0.4) loads, merges and serves bit for bit as the safetensors one.
"""
import json
import shutil

import numpy as np
import pytest

from fixture_cases import read_reference
from test_decoder_parity import FIXTURES
from vkformers.cli import main
from vkformers.engine.tensor import parameter, tensor
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.models.module import CheckpointError
from vkformers.models.safetensors_io import read_safetensors, write_safetensors
from vkformers.optim import AdamW
from vkformers.models.lora import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, PICKLED_ADAPTER_WEIGHTS, LoraError, PeftModel,
                                   check_adapter_folder, load_adapter, save_adapter, serve_adapters,
                                   trainable_parameters)

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


# ---------------------------------------------------------------- PEFT < 0.4's adapter_model.bin

PICKLED_ADAPTER = FIXTURES / "torch_pickle" / "llama_lora"  # this adapter torch.save'd (make_torch_pickle_fixtures)
IDS = np.array([[1, 5, 9, 2, 7, 30, 4]], np.int32)


def base_llama():
    return AutoModelForCausalLM.from_pretrained(FIXTURES / "llama", dtype="float32", requires_grad=False)


def test_a_pickled_adapter_gives_the_logits_of_its_safetensors_bit_for_bit():
    assert sorted(p.name for p in PICKLED_ADAPTER.iterdir()) == [ADAPTER_CONFIG, PICKLED_ADAPTER_WEIGHTS]
    expected = load_adapter(base_llama(), ADAPTER)(IDS).logits.numpy()
    assert np.abs(expected - base_llama()(IDS).logits.numpy()).max() > 0.1  # the adapter changes the logits
    np.testing.assert_array_equal(load_adapter(base_llama(), PICKLED_ADAPTER)(IDS).logits.numpy(), expected)
    np.testing.assert_array_equal(PeftModel.from_pretrained(base_llama(), PICKLED_ADAPTER)(IDS).logits.numpy(),
                                  expected)
    from_pretrained = AutoModelForCausalLM.from_pretrained(FIXTURES / "llama", dtype="float32", adapter=PICKLED_ADAPTER)
    np.testing.assert_array_equal(from_pretrained(IDS).logits.numpy(), expected)


def test_merge_lora_of_a_pickled_adapter_saves_what_its_safetensors_gives(tmp_path, capsys):
    """``vkformers merge-lora`` (what ``serve --adapter DIR`` and ``generate --adapter`` do at load: checked, loaded,
    merged): the merged weights are bit for bit those merged from the safetensors adapter."""
    merged = {}
    for name, folder in (("safetensors", ADAPTER), ("bin", PICKLED_ADAPTER)):
        assert main(["merge-lora", "--model", str(FIXTURES / "llama"), "--adapter", str(folder),
                     "--out", str(tmp_path / name), "--dtype", "float32"]) == 0
        merged[name] = {k: e.as_float() for k, e in read_safetensors(tmp_path / name / "model.safetensors").items()}
    assert sorted(merged["bin"]) == sorted(merged["safetensors"])
    for key, array in merged["safetensors"].items():
        np.testing.assert_array_equal(merged["bin"][key], array, err_msg=key)
    base = {k: e.as_float() for k, e in read_safetensors(FIXTURES / "llama" / "model.safetensors").items()}
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert np.abs(merged["bin"][q_proj] - base[q_proj]).max() > 1e-3  # the adapter was merged in


def test_a_pickled_adapter_served_by_name_rows_as_its_safetensors():
    """``serve --adapter NAME=DIR`` (serve_adapters): a row taking the .bin adapter gets the logits of a row taking
    the same adapter from safetensors, bit for bit (and those of the adapter loaded into the model, within 1e-6 of
    max |logit|), and check_adapter_folder accepts the folder."""
    assert check_adapter_folder(PICKLED_ADAPTER).r == 4
    model = base_llama()
    selector = serve_adapters(model, {"safetensors": ADAPTER, "bin": PICKLED_ADAPTER})
    with selector.selecting(tensor(selector.row_scales([1, 2]))):
        logits = model(np.concatenate([IDS, IDS])).logits.numpy()
    np.testing.assert_array_equal(logits[1], logits[0])
    # the adapter merged into one row's forward: a GPU's products of 1 and 2 rows may round apart in the last bit
    expected = load_adapter(base_llama(), ADAPTER)(IDS).logits.numpy()[0]
    assert np.abs(logits[0] - expected).max() <= 1e-6 * np.abs(expected).max()


def test_safetensors_is_read_before_a_pickled_adapter_and_neither_is_refused(tmp_path):
    """As PEFT: with both files the safetensors one is read (here zeroed B matrices, the base model's logits)."""
    both = tmp_path / "both"
    shutil.copytree(PICKLED_ADAPTER, both)
    entries = read_safetensors(ADAPTER / ADAPTER_WEIGHTS)
    write_safetensors(both / ADAPTER_WEIGHTS, {k: e.as_float() * (0 if ".lora_B." in k else 1)
                                               for k, e in entries.items()})
    np.testing.assert_array_equal(load_adapter(base_llama(), both)(IDS).logits.numpy(),
                                  base_llama()(IDS).logits.numpy())
    (both / ADAPTER_WEIGHTS).unlink()
    (both / PICKLED_ADAPTER_WEIGHTS).unlink()
    with pytest.raises(LoraError, match=r"no adapter_model\.safetensors \(nor adapter_model\.bin\)$"):
        load_adapter(base_llama(), both)
    (both / PICKLED_ADAPTER_WEIGHTS).write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match="adapter_model.bin: not a zip checkpoint"):
        load_adapter(base_llama(), both)
