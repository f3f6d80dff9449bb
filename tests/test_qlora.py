"""QLoRA end to end on tests/fixtures/qlora (tools/make_qlora_reference.py).

The fixture's model.safetensors holds a tiny Llama's weights as NF4 dequantizes them, so loading it with
quantization="nf4" packs every Linear back to the very same values, and loading it plainly gives the float32
model with those values: the QLoRA model and its float twin. Checked here: the adapters' gradients on the NF4
model against LoRA on the float twin (1e-3 relative to each tensor's largest element); the Trainer (gradient
checkpointing on) lowering the loss over 20 steps with the packed base untouched; an adapter vkformers trained on
the NF4 model and saved, against the logits PEFT computed with it over the float base (1e-4 absolute); and
``vkformers train --quantization``, with its refusals (one line each).
"""
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from vkformers.cli import main
from vkformers.engine.quantized import QuantizationError, QuantizedTensor
from vkformers.engine.tensor import Tensor
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.models.quantize import BitsAndBytesConfig
from vkformers.models.lora import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraConfig, apply_lora, load_adapter,
                                   save_adapter)
from vkformers.models.safetensors_io import read_safetensors
from vkformers.training import Batches, ByteTokenizer, Trainer, TrainingConfig
from vkformers.training.data import PackedDataset

FIXTURE = Path(__file__).parent / "fixtures" / "qlora"
TEXT = Path(__file__).parent.parent / "examples" / "data" / "shakespeare.txt"
REFERENCE_PYTHON = Path("/tmp/tfvenv/bin/python")  # torch, transformers and peft, for the live PEFT check
META = json.loads((FIXTURE / "meta.json").read_text())
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def stored_weights():
    return {name: entry.as_float() for name, entry in read_safetensors(FIXTURE / "model.safetensors").items()}


def load_nf4():
    return AutoModelForCausalLM.from_pretrained(FIXTURE, quantization="nf4")


def relative_error(got, want):
    return float(np.abs(got.astype(np.float64) - want).max() / np.abs(want.astype(np.float64)).max())


def shakespeare_batches(seq_len=32, batch_size=2, chars=4000):
    tokens = np.array(ByteTokenizer().encode(TEXT.read_text()[:chars]), np.int64)
    return Batches(PackedDataset(tokens, tokens, seq_len), batch_size, seed=0)


def test_nf4_packs_the_fixture_back_to_its_values():
    params = dict(load_nf4().named_parameters())
    packed = sorted(n for n, t in params.items() if isinstance(t, QuantizedTensor))
    assert packed == sorted(META["quantized_weights"]) and len(packed) == 14
    assert all(params[n].format.name == "nf4" for n in packed)
    weights = stored_weights()
    for name in packed:
        np.testing.assert_array_equal(params[name].numpy(), weights[name], err_msg=name)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_adapter_gradients_match_lora_on_the_dequantized_float_model(checkpointing):
    """The same adapters (A from seed 0, B set to fixed random values so that A gets a gradient too) on the NF4
    model and on the float32 model holding its dequantized weights: the same loss and gradients."""
    ids = np.array([list(b"To be, or not to be, that is the question:")], np.int32)
    rng = np.random.default_rng(3)
    b_values = {}
    results = []
    for model in (load_nf4(), AutoModelForCausalLM.from_pretrained(FIXTURE)):
        apply_lora(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS), seed=0)
        for name, t in model.named_parameters():
            if name.endswith("lora_B.weight"):
                values = b_values.setdefault(name, (0.05 * rng.standard_normal(t.shape)).astype(np.float32))
                t.assign(Tensor(values))
        if checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        out = model(ids, labels=ids)
        out.loss.backward()
        results.append((out.loss.item(), {n: t.grad.numpy() for n, t in model.named_parameters() if t.requires_grad}))
    (nf4_loss, nf4_grads), (float_loss, float_grads) = results
    assert sorted(nf4_grads) == sorted(float_grads) and len(nf4_grads) == 2 * 14  # only the adapters train
    assert abs(nf4_loss - float_loss) <= 1e-5 * abs(float_loss)
    for name in nf4_grads:
        assert np.abs(float_grads[name]).max() > 0, name
        assert relative_error(nf4_grads[name], float_grads[name]) < 1e-3, name


def test_trainer_lowers_the_loss_over_20_steps_with_the_packed_base_untouched(tmp_path):
    model = load_nf4()
    apply_lora(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS), seed=0)
    config = TrainingConfig(steps=20, batch_size=2, seq_len=32, lr=1e-2, schedule="constant",
                            gradient_checkpointing=True)
    trainer = Trainer(model.train(), config, shakespeare_batches(), out_dir=tmp_path / "run")
    assert len(trainer.params) == 2 * 14
    trainer.train()
    losses = [h["loss"] for h in trainer.history if "loss" in h]
    assert len(losses) == 20 and all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses  # 5.9 -> about 4.4 on this text
    params, weights = dict(model.named_parameters()), stored_weights()
    for name in META["quantized_weights"]:
        assert isinstance(params[name], QuantizedTensor)
        np.testing.assert_array_equal(params[name].numpy(), weights[name], err_msg=name)
    final = trainer.save_final()
    assert sorted(read_safetensors(final / ADAPTER_WEIGHTS)) == sorted(read_safetensors(FIXTURE / ADAPTER_WEIGHTS))


def test_saved_adapter_gives_the_logits_peft_computes_over_the_dequantized_base(tmp_path):
    """The fixture's adapter (vkformers' Trainer on the NF4 model, then save_final) loaded by PEFT over the float
    base gave peft_reference.safetensors; vkformers with the adapter on the NF4 model gives the same logits, and
    writes the adapter PEFT read back byte for byte."""
    reference = {k: e.as_float() for k, e in read_safetensors(FIXTURE / "peft_reference.safetensors").items()}
    ids = reference["input_ids"].astype(np.int32)
    model = load_adapter(load_nf4(), FIXTURE)
    logits = model(ids).logits.numpy()
    error = np.abs(logits - reference["logits"]).max()
    assert error <= 1e-4, f"logits differ from PEFT's by {error:.3g}"
    assert np.abs(load_nf4()(ids).logits.numpy() - logits).max() > 1.0  # the trained adapter changes them
    save_adapter(model, tmp_path / "again")
    assert json.loads((tmp_path / "again" / ADAPTER_CONFIG).read_text()) == \
        json.loads((FIXTURE / ADAPTER_CONFIG).read_text())
    saved = read_safetensors(tmp_path / "again" / ADAPTER_WEIGHTS)
    committed = read_safetensors(FIXTURE / ADAPTER_WEIGHTS)
    assert sorted(saved) == sorted(committed)
    for name in committed:
        np.testing.assert_array_equal(saved[name].as_float(), committed[name].as_float(), err_msg=name)


@pytest.mark.skipif(not REFERENCE_PYTHON.is_file(),
                    reason=f"no {REFERENCE_PYTHON} (torch, transformers, peft): the committed PEFT reference is "
                           "checked by test_saved_adapter_gives_the_logits_peft_computes_over_the_dequantized_base")
def test_freshly_trained_adapter_loads_in_peft(tmp_path):
    """An adapter trained here (3 steps) and saved: PEFT, run in a subprocess, loads it over the dequantized base
    and gives the logits vkformers gives on the NF4 model."""
    folder = tmp_path / "qlora"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((FIXTURE / name).read_bytes())
    model = load_nf4()
    apply_lora(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"]), seed=1)
    trainer = Trainer(model.train(), TrainingConfig(steps=3, batch_size=2, seq_len=32, lr=2e-2, schedule="constant",
                                                    gradient_checkpointing=True), shakespeare_batches())
    trainer.train()
    trainer.save_final(folder)
    tool = Path(__file__).parent.parent / "tools" / "make_qlora_reference.py"
    subprocess.run([str(REFERENCE_PYTHON), str(tool), "--peft", str(folder)], check=True, capture_output=True,
                   timeout=300)
    reference = {k: e.as_float() for k, e in read_safetensors(folder / "peft_reference.safetensors").items()}
    logits = model.eval()(reference["input_ids"].astype(np.int32)).logits.numpy()
    assert np.abs(logits - reference["logits"]).max() <= 1e-4
    assert json.loads((folder / "meta.json").read_text())["adapter_effect_max_abs"] > 0.01


# ---------------------------------------------------------------------------------------------- the CLI

def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT.read_text()[:3000])
    return path


def test_cli_trains_lora_on_an_nf4_base(tmp_path, capsys):
    base = tmp_path / "base"  # the fixture's model alone (no adapter beside it)
    base.mkdir()
    for name in ("config.json", "model.safetensors"):
        (base / name).write_bytes((FIXTURE / name).read_bytes())
    out = tmp_path / "run"
    assert main(["train", "--model", str(base), "--quantization", "nf4", "--lora-rank", "16",
                 "--gradient-checkpointing", "--tokenizer", "byte", "--data", str(corpus(tmp_path)), "--out", str(out),
                 "--steps", "3", "--batch-size", "2", "--seq-len", "16", "--lr", "1e-2", "--no-progress",
                 "--eval-fraction", "0.1"]) == 0
    printed = capsys.readouterr().out
    assert "; 14 quantized weights frozen under the adapters" in printed and "done: step 3" in printed
    state = json.loads((out / "checkpoints" / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["config"]["gradient_checkpointing"] is True and state["run"]["quantization"] == "nf4"
    adapter = out / "final"
    assert json.loads((adapter / ADAPTER_CONFIG).read_text())["r"] == 16
    assert not (adapter / "model.safetensors").exists()
    model = load_adapter(AutoModelForCausalLM.from_pretrained(base, quantization="nf4"), adapter)
    assert sum(isinstance(t, QuantizedTensor) for t in model.parameters()) == 14


@pytest.mark.parametrize("extra, message", [
    ([], "--quantization nf4 needs --lora-rank: quantized weights are frozen, so only LoRA adapters train on top "
         "of them (QLoRA); drop --quantization for full fine-tuning"),
    (["--lora-rank", "4", "--merge"], "--merge with --quantization nf4: the adapter cannot be folded into packed "
                                      "weights; drop --merge to save the adapter"),
    (["--lora-rank", "4", "--from-scratch"], "--quantization applies to trained weights, not --from-scratch"),
])
def test_cli_refuses_what_a_quantized_base_cannot_do_before_loading(tmp_path, capsys, extra, message):
    """One line, no traceback, before the data or the model are read (neither exists here)."""
    assert main(["train", "--model", str(tmp_path / "absent"), "--quantization", "nf4", "--data",
                 str(tmp_path / "absent.txt"), "--out", str(tmp_path / "run"), *extra]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"vkformers train: error: {message}") and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def gguf_q8_0(tmp_path_factory):
    """A GGUF file with Q8_0 weights: loaded quantized without --quantization."""
    pytest.importorskip("gguf", reason="the gguf extra writes the file")
    from test_gguf import random_llama, train_bpe, write_tiny_gguf
    backend = train_bpe()
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf",
                           random_llama(backend.get_vocab_size(), seed=21), backend, quant="Q8_0")


@pytest.mark.parametrize("extra, message", [
    ([], "full fine-tuning refused: 15 weight(s) of this model are quantized (model.embed_tokens.weight, ...); "
         "quantized weights are frozen in their packed blocks; add --lora-rank to train LoRA adapters on top of them "
         "(QLoRA)\n"),
    (["--lora-rank", "4", "--merge"], "--merge refused: 15 weight(s) of this model are quantized "),
])
def test_cli_refuses_full_fine_tuning_of_a_quantized_gguf(tmp_path, capsys, gguf_q8_0, extra, message):
    assert main(["train", "--model", str(gguf_q8_0), "--tokenizer", "byte", "--data", str(corpus(tmp_path)),
                 "--out", str(tmp_path / "run"), "--steps", "1", "--no-progress", *extra]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"vkformers train: error: {message}") and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def packed_formats(model):
    return {n: t.format.name for n, t in model.named_parameters() if isinstance(t, QuantizedTensor)}


def test_transformers_quantization_config_packs_as_quantization_does():
    """BitsAndBytesConfig (the object or its dict) and load_in_4bit / load_in_8bit load the weights packed as
    quantization="nf4" / "q8_0" does, computing in bnb_4bit_compute_dtype; FP4 is packed as NF4 with a warning."""
    ids = np.array([[1, 5, 9, 2, 7]], np.int64)
    nf4 = AutoModelForCausalLM.from_pretrained(FIXTURE, quantization="nf4", dtype="bfloat16")
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype="torch.bfloat16",
                                bnb_4bit_use_double_quant=True)
    for options in ({"quantization_config": config}, {"quantization_config": config.to_dict()}):
        model = AutoModelForCausalLM.from_pretrained(FIXTURE, **options)
        assert model.dtype.name == "bfloat16" and packed_formats(model) == packed_formats(nf4)
        np.testing.assert_array_equal(model(ids).logits.float().numpy(), nf4(ids).logits.float().numpy())
    with pytest.warns(UserWarning, match="FP4 is not offered; the weights are packed as NF4"):
        fp4 = AutoModelForCausalLM.from_pretrained(FIXTURE, load_in_4bit=True)
    assert set(packed_formats(fp4).values()) == {"nf4"} and fp4.dtype.name == "float32"
    q8 = AutoModelForCausalLM.from_pretrained(FIXTURE, load_in_8bit=True)
    assert packed_formats(q8) == {n: "q8_0" for n in packed_formats(nf4)}
    for options, message in [({"quantization": "nf4", "load_in_4bit": True}, "give one of them"),
                             ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quant_method 'gptq'"),
                             ({"quantization_config": {"load_in_4bit": True, "load_in_8bit": True}}, "set one of"),
                             ({"quantization_config": BitsAndBytesConfig(load_in_8bit=True,
                                                                         llm_int8_skip_modules=["mlp"])},
                              r"llm_int8_skip_modules \['mlp'\]")]:
        with pytest.raises(QuantizationError, match=message):
            AutoModelForCausalLM.from_pretrained(FIXTURE, **options)
