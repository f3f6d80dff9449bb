"""LoRA: wrapping by name/regex, frozen base, training only adapters, PEFT file format, load and merge."""
import json
import math
from pathlib import Path

import numpy as np
import pytest

import vkformers as vkf
from test_training import tiny_data, tiny_model
from vkformers.training import Batches, LoraConfig, Trainer, TrainingConfig, apply_lora, load_adapter, merge_lora
from vkformers.models.lora import LoraError, LoraLinear, resolve_targets, save_adapter
from vkformers.models.safetensors_io import read_safetensors

IDS = np.array([[3, 70, 101, 32, 5, 200, 9, 1]], np.int32)


def logits(model):
    return model(IDS).logits.numpy()


def test_targets_by_suffix_list_regex_and_default():
    model = tiny_model()
    assert resolve_targets(model, None) == ["layers.0.q_proj", "layers.0.v_proj"]
    assert resolve_targets(model, ["o_proj", "lm_head"]) == ["layers.0.o_proj", "lm_head"]
    assert resolve_targets(model, r".*\.(k|v)_proj") == ["layers.0.k_proj", "layers.0.v_proj"]
    with pytest.raises(LoraError, match="match no Linear.*q_proj"):
        resolve_targets(model, ["query"])


def test_wrapping_keeps_names_freezes_the_base_and_starts_unchanged():
    model = tiny_model()
    before = logits(model)
    apply_lora(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]))
    names = dict(model.named_parameters())
    assert "layers.0.q_proj.weight" in names and "layers.0.q_proj.lora_A.weight" in names
    assert names["layers.0.q_proj.lora_A.weight"].shape == (4, 32)
    assert names["layers.0.q_proj.lora_B.weight"].shape == (32, 4)
    trainable = sorted(n for n, t in names.items() if t.requires_grad)
    assert trainable == ["layers.0.q_proj.lora_A.weight", "layers.0.q_proj.lora_B.weight",
                         "layers.0.v_proj.lora_A.weight", "layers.0.v_proj.lora_B.weight", "lm_head.weight"]
    np.testing.assert_allclose(logits(model), before, rtol=1e-6, atol=1e-6)  # B = 0


def test_forward_matches_the_lora_formula():
    model = tiny_model()
    apply_lora(model, LoraConfig(r=2, lora_alpha=3, target_modules=["up_proj"], use_rslora=True))
    layer = model.layers[0].up_proj
    assert isinstance(layer, LoraLinear) and layer.scaling == pytest.approx(3 / math.sqrt(2))
    rng = np.random.default_rng(0)
    layer.lora_B.weight = vkf.parameter(rng.standard_normal((64, 2)).astype(np.float32))
    x = rng.standard_normal((3, 32)).astype(np.float32)
    w, b = layer.weight.numpy(), layer.bias.numpy()
    a, bb = layer.lora_A.weight.numpy(), layer.lora_B.weight.numpy()
    expected = x @ w.T + b + (x @ a.T @ bb.T) * layer.scaling
    np.testing.assert_allclose(layer(vkf.tensor(x)).numpy(), expected, rtol=1e-5, atol=1e-5)


def test_training_moves_only_the_adapters_and_bf16_base_stays_bf16(tmp_path):
    model = tiny_model(dtype="bfloat16")
    base_q = model.layers[0].q_proj.weight.numpy().copy()
    apply_lora(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1))
    config = TrainingConfig(steps=6, batch_size=4, seq_len=16, lr=2e-2, precision="bf16", schedule="constant")
    trainer = Trainer(model, config, Batches(tiny_data(), 4), out_dir=tmp_path)
    results = trainer.train()
    assert results[-1]["loss"] < results[0]["loss"]
    q = model.layers[0].q_proj
    assert q.weight.dtype is vkf.bfloat16 and q.lora_A.weight.dtype is vkf.float32
    np.testing.assert_array_equal(q.weight.numpy(), base_q)
    assert np.abs(q.lora_B.weight.numpy()).max() > 0
    assert len(trainer.optimizer.state) == 4


def test_adapter_files_are_peft_format_and_reload_to_the_same_outputs(tmp_path):
    model = tiny_model()
    apply_lora(model, LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"],
                                 base_model_name_or_path="org/tiny"))
    rng = np.random.default_rng(1)
    for _, m in model.named_modules():
        if isinstance(m, LoraLinear):
            m.lora_B.weight = vkf.parameter(rng.standard_normal(m.lora_B.weight.shape).astype(np.float32) * 0.1)
    expected = logits(model)
    save_adapter(model, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert {k: config[k] for k in ("peft_type", "r", "lora_alpha", "target_modules", "lora_dropout", "use_rslora",
                                   "modules_to_save", "bias", "task_type", "base_model_name_or_path")} == {
        "peft_type": "LORA", "r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0,
        "use_rslora": False, "modules_to_save": ["lm_head"], "bias": "none", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "org/tiny"}
    keys = sorted(read_safetensors(tmp_path / "adapter_model.safetensors"))
    assert keys == ["base_model.model.layers.0.q_proj.lora_A.weight", "base_model.model.layers.0.q_proj.lora_B.weight",
                    "base_model.model.layers.0.v_proj.lora_A.weight", "base_model.model.layers.0.v_proj.lora_B.weight",
                    "base_model.model.lm_head.weight"]

    fresh = tiny_model()
    load_adapter(fresh, tmp_path)
    assert not any(t.requires_grad for t in fresh.parameters())
    np.testing.assert_allclose(logits(fresh), expected, rtol=1e-5, atol=1e-5)

    merged = merge_lora(fresh)
    assert not any(isinstance(m, LoraLinear) for _, m in merged.named_modules())
    assert sorted(n for n, _ in merged.named_parameters()) == sorted(n for n, _ in tiny_model().named_parameters())
    np.testing.assert_allclose(logits(merged), expected, rtol=1e-4, atol=1e-4)


def test_save_pretrained_of_a_lora_model_writes_the_adapter_as_peft_does(tmp_path):
    """PeftModel.save_pretrained writes the adapter: so does save_pretrained of a model with adapters (a checkpoint
    of base and adapter tensors under one name loads nowhere); after merge_lora it writes the whole model."""
    from vkformers import AutoModelForCausalLM
    fixture = Path(__file__).parent / "fixtures" / "llama"
    model = AutoModelForCausalLM.from_pretrained(fixture)
    apply_lora(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path / "adapter")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json",
                                                                       "adapter_model.safetensors"]
    again = AutoModelForCausalLM.from_pretrained(fixture, adapter=tmp_path / "adapter")
    ids = np.array([[1, 5, 9, 2]])
    np.testing.assert_array_equal(again(ids).logits.numpy(), model(ids).logits.numpy())
    with pytest.raises(LoraError, match="adapter is written in float32"):
        model.save_pretrained(tmp_path / "bf16", dtype="bfloat16")
    merge_lora(model).save_pretrained(tmp_path / "merged")
    np.testing.assert_allclose(AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(ids).logits.numpy(),
                               model(ids).logits.numpy(), rtol=1e-5, atol=1e-5)


def test_peft_names_and_all_linear(tmp_path, capsys):
    """Code written for PEFT: get_peft_model with target_modules="all-linear" (every Linear layer but lm_head,
    saved as the names it expands to), print_trainable_parameters' line, PeftModel.from_pretrained, and
    merge_and_unload."""
    from vkformers import AutoModelForCausalLM
    from vkformers.training import PeftModel, get_peft_model
    fixture = Path(__file__).parent / "fixtures" / "llama"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(fixture), LoraConfig(r=2, target_modules="all-linear"))
    wrapped = sorted(n for n, m in model.named_modules() if isinstance(m, LoraLinear))
    linears = [n for n, m in AutoModelForCausalLM.from_pretrained(fixture).named_modules()
               if type(m).__name__ == "Linear"]
    assert wrapped == sorted(n for n in linears if n != "lm_head") and "lm_head" in linears
    assert model.lora_config.target_modules == sorted({n.rsplit(".", 1)[-1] for n in wrapped})
    from vkformers.cli.train import lora_targets
    assert lora_targets(["all-linear"]) == "all-linear"  # vkformers train --lora-targets all-linear
    model.print_trainable_parameters()
    trainable = sum(2 * (m.in_features + m.out_features) for _, m in model.named_modules() if isinstance(m, LoraLinear))
    total = model.num_parameters()
    assert capsys.readouterr().out == (f"trainable params: {trainable:,d} || all params: {total:,d} || "
                                       f"trainable%: {100 * trainable / total:.4f}\n")
    rng = np.random.default_rng(0)
    for _, m in model.named_modules():
        if isinstance(m, LoraLinear):
            m.lora_B.weight = vkf.parameter(rng.standard_normal(m.lora_B.weight.shape).astype(np.float32) * 0.1)
    ids = np.array([[1, 5, 9, 2]])
    expected = model(ids).logits.numpy()
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(fixture), tmp_path)
    np.testing.assert_allclose(loaded(ids).logits.numpy(), expected, rtol=1e-5, atol=1e-5)
    merged = loaded.merge_and_unload()
    assert merged is loaded and not hasattr(merged, "lora_config")
    assert not any(isinstance(m, LoraLinear) for _, m in merged.named_modules())
    np.testing.assert_allclose(merged(ids).logits.numpy(), expected, rtol=1e-4, atol=1e-4)


def test_adapters_that_do_not_fit_are_refused(tmp_path):
    model = tiny_model()
    apply_lora(model, LoraConfig(r=2, target_modules=["q_proj"]))
    save_adapter(model, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "k_proj"]  # the file has no k_proj tensors
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoraError, match="does not fit.*k_proj"):
        load_adapter(tiny_model(), tmp_path)
    cfg["peft_type"] = "IA3"
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoraError, match="LORA adapters only"):
        load_adapter(tiny_model(), tmp_path)


def tiny_llama_folder(folder):
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 257, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
              "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_cli_train_from_scratch_then_lora_then_merge(tmp_path, capsys):
    from vkformers.cli import main
    from vkformers.models.loading import AutoModelForCausalLM
    try:
        AutoModelForCausalLM.from_config(json.loads(json.dumps({"model_type": "llama", "vocab_size": 8,
                                                               "hidden_size": 8, "intermediate_size": 8,
                                                               "num_hidden_layers": 1, "num_attention_heads": 1})))
    except Exception as exc:  # the llama plugin's model is not installed
        pytest.skip(f"no llama causal-LM implementation: {exc}")
    config = tiny_llama_folder(tmp_path / "config")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question. " * 40)
    common = ["--tokenizer", "byte", "--data", str(corpus), "--steps", "3", "--batch-size", "2", "--seq-len", "16",
              "--lr", "1e-2", "--no-progress", "--eval-fraction", "0.1"]
    assert main(["train", "--model", str(config), "--from-scratch", "--out", str(tmp_path / "full"), *common]) == 0
    base = tmp_path / "full" / "final"
    assert (base / "model.safetensors").is_file() and (tmp_path / "full" / "loss_curve.png").is_file()
    assert main(["train", "--model", str(base), "--out", str(tmp_path / "lora"), "--lora-rank", "2",
                 "--lora-targets", "q_proj,v_proj,o_proj", *common]) == 0
    adapter = tmp_path / "lora" / "final"
    assert json.loads((adapter / "adapter_config.json").read_text())["target_modules"] == ["o_proj", "q_proj",
                                                                                          "v_proj"]
    assert "done: step 3" in capsys.readouterr().out
    assert main(["merge-lora", "--model", str(base), "--adapter", str(adapter), "--out", str(tmp_path / "merged")]) == 0

    with_adapter = load_adapter(AutoModelForCausalLM.from_pretrained(base), adapter)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    plain = AutoModelForCausalLM.from_pretrained(base)
    ids = np.array([[84, 111, 32, 98, 101]], np.int32)
    expected = with_adapter(ids).logits.numpy()
    np.testing.assert_allclose(merged(ids).logits.numpy(), expected, rtol=1e-4, atol=1e-4)
    assert np.abs(plain(ids).logits.numpy() - expected).max() > 1e-4  # the adapter did something


def test_disable_adapter_gives_the_base_model_and_then_the_adapter_again():
    """PEFT's disable_adapter(): inside it logits and generate's tokens are the base model's (its recorded decode
    steps dropped on the way in and out), after it the adapted model's again; unload() drops the adapters."""
    from vkformers.models.loading import AutoModelForCausalLM
    folder = Path(__file__).parent / "data" / "pipeline"
    base = AutoModelForCausalLM.from_pretrained(folder, requires_grad=False)
    model = AutoModelForCausalLM.from_pretrained(folder, requires_grad=False)
    apply_lora(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    rng = np.random.default_rng(1)
    for _, layer in model.named_modules():
        if isinstance(layer, LoraLinear):
            layer.lora_B.weight = vkf.parameter(rng.standard_normal(layer.lora_B.weight.shape).astype(np.float32))
    ids = np.array([[5, 17, 22, 9, 14, 41]], np.int64)
    adapted_logits, adapted_tokens = model(ids).logits.numpy(), model.generate(ids, max_new_tokens=6)
    base_tokens = base.generate(ids, max_new_tokens=6)
    assert adapted_tokens.tolist() != base_tokens.tolist()
    with model.disable_adapter():
        np.testing.assert_allclose(model(ids).logits.numpy(), base(ids).logits.numpy(), rtol=0, atol=1e-6)
        assert model.generate(ids, max_new_tokens=6).tolist() == base_tokens.tolist()
    np.testing.assert_allclose(model(ids).logits.numpy(), adapted_logits, rtol=0, atol=1e-6)
    assert model.generate(ids, max_new_tokens=6).tolist() == adapted_tokens.tolist()
    assert model.unload() is model and not any(isinstance(m, LoraLinear) for _, m in model.named_modules())
    assert model.generate(ids, max_new_tokens=6).tolist() == base_tokens.tolist()  # PEFT's unload: the base again


@pytest.mark.parametrize("folder, kind, suffixes", [
    ("phi", vkf.AutoModelForCausalLM, {"q_proj", "v_proj", "fc1", "fc2"}),       # PEFT adapts Phi's MLP too
    ("encoders/deberta-v2", vkf.AutoModelForMaskedLM, {"query_proj", "value_proj"}),
    ("encoders/electra", vkf.AutoModelForMaskedLM, {"query", "value"}),
    ("seq2seq/t5", vkf.AutoModelForSeq2SeqLM, {"q", "v"}),
])
def test_default_targets_are_peft_s(folder, kind, suffixes):
    """LoraConfig() without target_modules adapts the layers PEFT's default for the model type names (peft 0.21's
    TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING), every layer's."""
    model = kind.from_pretrained(Path(__file__).parent / "fixtures" / folder, dtype="float32")
    chosen = resolve_targets(model, None)
    assert {name.rsplit(".", 1)[-1] for name in chosen} == suffixes
    layers = model.config.get("num_hidden_layers") or model.config.get("num_layers")
    assert len(chosen) >= len(suffixes) * layers


def test_lora_config_defaults_are_peft_s():
    """peft 0.21's LoraConfig(): r 8, lora_alpha 8 (scaling 1), no dropout, no bias, no rsLoRA."""
    config = LoraConfig()
    assert (config.r, config.lora_alpha, config.lora_dropout, config.bias, config.use_rslora) == (8, 8, 0.0, "none",
                                                                                                  False)
    assert config.scaling == 1.0


def test_peft_s_target_narrowing_and_init_options():
    """exclude_modules (names or a regex), layers_to_transform (with or without layers_pattern) and
    init_lora_weights as PEFT reads them; the PEFT options vkformers does not implement are refused by name, and
    the chosen options round-trip through adapter_config.json."""
    model = vkf.AutoModelForCausalLM.from_pretrained(Path(__file__).parent / "fixtures" / "llama", dtype="float32")
    layers = model.config["num_hidden_layers"]
    assert layers >= 2
    every = resolve_targets(model, ["q_proj", "v_proj"])
    assert len(every) == 2 * layers
    config = LoraConfig(target_modules=["q_proj", "v_proj"], exclude_modules=["v_proj"])
    assert resolve_targets(model, config.target_modules, config) == [n for n in every if n.endswith("q_proj")]
    config = LoraConfig(target_modules=["q_proj", "v_proj"], exclude_modules=r".*\.0\..*")
    assert resolve_targets(model, config.target_modules, config) == [n for n in every if ".0." not in n]
    for pattern in (None, "layers", ["h", "layers"]):
        config = LoraConfig(target_modules=["q_proj", "v_proj"], layers_to_transform=[1], layers_pattern=pattern)
        assert resolve_targets(model, config.target_modules, config) == [n for n in every if ".layers.1." in n]
    config = LoraConfig(target_modules=["q_proj"], layers_to_transform=0, layers_pattern="blocks")
    with pytest.raises(LoraError, match="match no Linear layer"):  # no layer list of that name
        resolve_targets(model, config.target_modules, config)
    for option, value in (("use_dora", True), ("fan_in_fan_out", True), ("init_lora_weights", "pissa"),
                          ("rank_pattern", {"q_proj": 4})):
        with pytest.raises(LoraError, match=f"{option}"):
            LoraConfig(**{option: value})
    saved = LoraConfig(target_modules=["q_proj"], exclude_modules=["v_proj"], layers_to_transform=[1],
                       init_lora_weights="gaussian").to_peft_dict()
    again = LoraConfig.from_peft_dict(json.loads(json.dumps(saved)))
    assert (again.exclude_modules, again.layers_to_transform, again.init_lora_weights) == (["v_proj"], [1],
                                                                                             "gaussian")
    with pytest.raises(LoraError, match=r"^adapter config: use_dora=True is not supported"):
        LoraConfig.from_peft_dict({**saved, "use_dora": True})


@pytest.mark.parametrize("how", [True, "gaussian", False])
def test_init_lora_weights(how):
    """True: A uniform in +-1/sqrt(in), B zero; "gaussian": A ~ N(0, 1/r), B zero; False: B drawn too."""
    model = vkf.AutoModelForCausalLM.from_pretrained(Path(__file__).parent / "fixtures" / "llama", dtype="float32")
    apply_lora(model, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=how), seed=0)
    layer = next(m for _, m in model.named_modules() if isinstance(m, LoraLinear))
    a, b = layer.lora_A.weight.numpy(), layer.lora_B.weight.numpy()
    assert (np.abs(b).max() > 0) == (how is False)
    if how == "gaussian":
        assert abs(a.std() - 1 / 4) < 0.05 and np.abs(a).max() > 1 / np.sqrt(layer.in_features)
    else:
        assert np.abs(a).max() <= 1 / np.sqrt(layer.in_features)
