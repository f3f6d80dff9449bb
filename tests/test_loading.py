"""Checkpoint interchange: save_pretrained round trip, sharded files, and every bad input's error message."""
import json
import shutil

import numpy as np
import pytest

from vkformers import AutoModelForCausalLM
from vkformers.errors import UnknownArchitectureError, VkformersError
from vkformers.models.loading import HubError, load_config, resolve_checkpoint
from vkformers.models.module import CheckpointError
from vkformers.models.safetensors_io import read_safetensors, write_safetensors

FIXTURE = __import__("pathlib").Path(__file__).parent / "fixtures" / "llama"
IDS = np.array([[1, 5, 9, 2, 7]])


@pytest.fixture()
def checkpoint(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(FIXTURE / "config.json", folder)
    shutil.copy(FIXTURE / "model.safetensors", folder)
    return folder


def weights(folder):
    return {k: e.as_float() for k, e in read_safetensors(folder / "model.safetensors").items()}


def test_save_pretrained_round_trip_in_float32_and_bfloat16(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(FIXTURE)
    logits = model(IDS).logits.numpy()
    model.save_pretrained(tmp_path / "f32")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "f32")
    np.testing.assert_array_equal(again(IDS).logits.numpy(), logits)
    assert set(weights(tmp_path / "f32")) == set(weights(FIXTURE))  # HF names, tied weights once
    model.save_pretrained(tmp_path / "bf16", dtype="bfloat16")
    stored = read_safetensors(tmp_path / "bf16" / "model.safetensors")
    assert {e.code for e in stored.values()} == {"BF16"}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    np.testing.assert_allclose(AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")(IDS).logits.numpy(), logits,
                               atol=0.1)


def test_load_state_dict_sets_the_compute_dtype(checkpoint):
    """from_config + load_state_dict(dtype=bfloat16) computes in bfloat16, as from_pretrained(dtype=...) does."""
    model = AutoModelForCausalLM.from_config(json.loads((checkpoint / "config.json").read_text()))
    model.load_state_dict(weights(checkpoint), dtype="bfloat16")
    assert model.dtype.name == "bfloat16"
    want = AutoModelForCausalLM.from_pretrained(checkpoint, dtype="bfloat16")(IDS).logits.numpy()
    np.testing.assert_array_equal(model(IDS).logits.numpy(), want)


def test_sharded_checkpoint(checkpoint):
    arrays = weights(checkpoint)
    names = sorted(arrays)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        write_safetensors(checkpoint / file, {n: arrays[n] for n in part})
    (checkpoint / "model.safetensors").unlink()
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f for f, part in halves.items() for n in part}}))
    reference = AutoModelForCausalLM.from_pretrained(FIXTURE)(IDS).logits.numpy()
    np.testing.assert_array_equal(AutoModelForCausalLM.from_pretrained(checkpoint)(IDS).logits.numpy(), reference)


@pytest.mark.parametrize("wrapper, layout", [("llava", "transformers 5"), ("mistral3", "transformers 4")])
def test_multimodal_wrapper_checkpoint_runs_its_language_model(checkpoint, wrapper, layout):
    """A LLaVA-style checkpoint (config with a nested text_config; language-model weights under
    model.language_model.* in transformers 5, language_model.model.* in 4.x, beside a vision tower)
    loads as its text model, with the same logits as the text checkpoint."""
    text_config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(
        {"model_type": wrapper, "text_config": text_config, "vision_config": {"model_type": "pixtral"}}))
    prefix, head = (("model.language_model.", "lm_head.") if layout == "transformers 5"
                    else ("language_model.model.", "language_model.lm_head."))
    arrays = {(head + n[len("lm_head."):] if n.startswith("lm_head.") else prefix + n[len("model."):]): a
              for n, a in weights(checkpoint).items()}
    arrays["model.vision_tower.patch_conv.weight" if layout == "transformers 5"
           else "vision_tower.patch_conv.weight"] = np.ones((2, 3), np.float32)
    write_safetensors(checkpoint / "model.safetensors", arrays)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert model.config == text_config
    reference = AutoModelForCausalLM.from_pretrained(FIXTURE)(IDS).logits.numpy()
    np.testing.assert_array_equal(model(IDS).logits.numpy(), reference)


def test_corrupt_safetensors(checkpoint):
    data = (checkpoint / "model.safetensors").read_bytes()
    (checkpoint / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor .* \(truncated or corrupt\)"):
        AutoModelForCausalLM.from_pretrained(checkpoint)
    (checkpoint / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        AutoModelForCausalLM.from_pretrained(checkpoint)


def test_missing_tensor(checkpoint):
    arrays = weights(checkpoint)
    del arrays["model.layers.1.mlp.down_proj.weight"]
    write_safetensors(checkpoint / "model.safetensors", arrays)
    with pytest.raises(CheckpointError, match=r"lacks 1 tensor.*model.layers.1.mlp.down_proj.weight"):
        AutoModelForCausalLM.from_pretrained(checkpoint)


def test_shape_mismatch(checkpoint):
    arrays = weights(checkpoint)
    arrays["model.norm.weight"] = np.ones(7, np.float32)
    write_safetensors(checkpoint / "model.safetensors", arrays)
    with pytest.raises(CheckpointError, match=r"model.norm.weight: checkpoint shape \(7,\), model expects \(32,\)"):
        AutoModelForCausalLM.from_pretrained(checkpoint)


def test_unknown_model_type_names_close_matches(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config["model_type"] = "lama"
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnknownArchitectureError, match=r"'lama'.*llama"):
        AutoModelForCausalLM.from_pretrained(checkpoint)


def test_a_bin_that_is_not_a_torch_checkpoint_and_remote_code_are_refused(checkpoint):
    """pytorch_model.bin is read as torch.save writes it (tests/test_torch_pickle.py); other bytes are refused."""
    (checkpoint / "model.safetensors").rename(checkpoint / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin: not a zip checkpoint of torch >= 1.6"):
        AutoModelForCausalLM.from_pretrained(checkpoint)
    with pytest.raises(VkformersError, match="never runs code"):
        AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True)


def test_offline_hub_miss_names_repo_and_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubError, match=r"'someone/missing-model' offline .* cache .*hub-cache"):
        resolve_checkpoint("someone/missing-model", cache_dir=tmp_path / "hub-cache")


def test_transformers_loading_options(checkpoint, tmp_path, monkeypatch):
    """What code written for transformers passes: torch_dtype for dtype, device_map="auto", an attention
    implementation, low_cpu_mem_usage; a token and local_files_only reach the hub download. A device_map that
    places the model elsewhere, two dtypes or an unknown attention implementation are refused by name."""
    want = AutoModelForCausalLM.from_pretrained(checkpoint, dtype="bfloat16")(IDS).logits.numpy()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype="bfloat16", device_map="auto",
                                                 attn_implementation="sdpa", low_cpu_mem_usage=True)
    assert model.dtype.name == "bfloat16"
    np.testing.assert_array_equal(model(IDS).logits.numpy(), want)

    class TorchDtype:  # str() of torch.bfloat16
        def __str__(self):
            return "torch.bfloat16"
    assert AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=TorchDtype()).dtype.name == "bfloat16"
    for options, message in [(dict(device_map="cuda:0"), r"device_map='cuda:0': vkformers puts the whole model"),
                             (dict(dtype="float16", torch_dtype="bfloat16"), r"give one of them"),
                             (dict(attn_implementation="fast"), r"attn_implementation='fast': not one of")]:
        with pytest.raises(VkformersError, match=message):
            AutoModelForCausalLM.from_pretrained(checkpoint, **options)
    import huggingface_hub
    seen = {}

    def fake_snapshot_download(repo_id, **kwargs):
        seen.update(kwargs)
        return str(checkpoint)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    AutoModelForCausalLM.from_pretrained("someone/gated-model", token="hf_secret", local_files_only=True)
    assert seen["token"] == "hf_secret" and seen["local_files_only"] is True


def test_olmo_hybrid_convs_saved_as_equal_chunks_are_resplit():
    """transformers 5.24 saves OLMo Hybrid's q/k/v_conv1d as three EQUAL chunks of their concatenation (torch.chunk)
    whatever the key and value widths; loading re-splits them at their sizes, as the released checkpoints hold them."""
    pytest.importorskip("vkformers_llama")
    config = json.loads((FIXTURE.parent / "olmo_hybrid" / "config.json").read_text())
    config["linear_value_head_dim"] = 8  # value width 4 * 8 = 32, key width 2 * 8 = 16
    model = AutoModelForCausalLM.from_config(config)
    rng = np.random.default_rng(0)
    arrays = {n: rng.standard_normal(s.shape).astype(np.float32) for n, s in model.named_slots()}
    convs = [f"model.layers.0.linear_attn.{c}_conv1d.weight" for c in "qkv"]
    full = np.concatenate([arrays[n] for n in convs])
    size = -(-len(full) // 3)  # torch.chunk: ceil-sized chunks, the last one smaller
    chunked = dict(arrays, **{n: full[i * size:(i + 1) * size] for i, n in enumerate(convs)})
    assert [len(chunked[n]) for n in convs] == [22, 22, 20]
    model.load_state_dict(chunked)
    params = dict(model.named_parameters())
    for n in convs:
        np.testing.assert_array_equal(params[n].numpy(), arrays[n])


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", r"config.json: expected a JSON object of settings, got a JSON list"),
    ('{"model_type": "llama",', r"config.json: not valid JSON"),
])
def test_config_that_is_not_a_json_object(checkpoint, content, message):
    (checkpoint / "config.json").write_text(content)
    with pytest.raises(CheckpointError, match=message):
        AutoModelForCausalLM.from_pretrained(checkpoint)


@pytest.mark.parametrize("field, value, expected", [
    ("hidden_size", "32", r"hidden_size is '32' \(a JSON string\), expected an integer >= 0; fix hidden_size"),
    ("hidden_size", -32, r"hidden_size is -32 \(a JSON number\), expected an integer >= 0; fix hidden_size"),
    ("num_attention_heads", 4.0, r"num_attention_heads is 4.0 \(a JSON number\), expected an integer >= 0"),
    ("num_hidden_layers", None, r"num_hidden_layers is None \(a JSON null\), expected an integer >= 0"),
    ("rms_norm_eps", "1e-6", r"rms_norm_eps is '1e-6' \(a JSON string\), expected a number"),
    ("tie_word_embeddings", "false", r"tie_word_embeddings is 'false' \(a JSON string\), expected true or false"),
    ("model_type", 7, r"model_type is 7 \(a JSON number\), expected a string"),
])
def test_config_field_of_the_wrong_type_is_named(checkpoint, field, value, expected):
    from vkformers.models.config_check import ConfigError
    config = json.loads((checkpoint / "config.json").read_text())
    config[field] = value
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=expected):
        AutoModelForCausalLM.from_pretrained(checkpoint)
    with pytest.raises(ConfigError, match=expected):
        AutoModelForCausalLM.from_config(config)


def test_query_heads_that_kv_heads_do_not_divide_are_named_at_load(checkpoint):
    from vkformers.models.config_check import ConfigError
    config = json.loads((checkpoint / "config.json").read_text())
    config["num_key_value_heads"] = config["num_attention_heads"] + 1
    (checkpoint / "config.json").write_text(json.dumps(config))
    expected = (rf"num_attention_heads {config['num_attention_heads']} is not a multiple of num_key_value_heads "
                rf"{config['num_key_value_heads']} \(each key/value head serves a whole group of query heads\)")
    with pytest.raises(ConfigError, match=expected):
        AutoModelForCausalLM.from_pretrained(checkpoint)


def test_wrapper_config_fields_are_checked_in_the_nested_text_config(checkpoint):
    from vkformers.models.config_check import ConfigError
    text_config = json.loads((checkpoint / "config.json").read_text())
    text_config["intermediate_size"] = "64"
    with pytest.raises(ConfigError, match=r"nested text model.*intermediate_size is '64'"):
        AutoModelForCausalLM.from_config({"model_type": "llava", "text_config": text_config,
                                          "vision_config": {"model_type": "pixtral"}})


def test_shard_index_without_weight_map_or_pointing_outside_the_folder(checkpoint, tmp_path):
    index = checkpoint / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 1}}))
    with pytest.raises(CheckpointError, match=r"index.json: no \"weight_map\" object"):
        AutoModelForCausalLM.from_pretrained(checkpoint)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(checkpoint / "model.safetensors", elsewhere)
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": "../elsewhere/model.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"shard '../elsewhere/model.safetensors' lies outside the model folder"):
        AutoModelForCausalLM.from_pretrained(checkpoint)
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": str(elsewhere / "model.safetensors")}}))
    with pytest.raises(CheckpointError, match=r"lies outside the model folder"):
        AutoModelForCausalLM.from_pretrained(checkpoint)


def test_load_config_reads_the_non_finite_floats_transformers_writes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "mamba2", "time_step_limit": [0.0, {"__float__": "Infinity"}],
        "nested": {"low": {"__float__": "-Infinity"}, "keep": {"__float__": "other", "x": 1}}}))
    config = load_config(tmp_path)
    assert config["time_step_limit"] == [0.0, float("inf")]
    assert config["nested"] == {"low": float("-inf"), "keep": {"__float__": "other", "x": 1}}


def test_config_reads_as_attributes_and_parameters_count_as_transformers(checkpoint, tmp_path):
    """model.config.vocab_size as in transformers (and the dict it is); num_parameters counts a tied weight once,
    only_trainable the ones that train."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    stored = json.loads((checkpoint / "config.json").read_text())
    assert model.config.vocab_size == model.config["vocab_size"] == stored["vocab_size"]
    assert model.config.to_dict() == {**stored, **model.config.to_dict()}
    model.config.use_cache = False
    assert model.config["use_cache"] is False and not hasattr(model.config, "no_such_field")
    model.save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["use_cache"] is False
    assert model.num_parameters() == sum(a.size for a in weights(checkpoint).values())
    assert model.num_parameters(only_trainable=True) == model.num_parameters()
    frozen = AutoModelForCausalLM.from_pretrained(checkpoint, requires_grad=False)
    assert frozen.num_parameters(only_trainable=True) == 0


@pytest.mark.parametrize("fixture", ["llama", "gpt2"])  # an untied and a tied LM head
def test_resize_token_embeddings_after_adding_tokens(fixture, tmp_path):
    """transformers' way to fine-tune with new tokens: the tokenizer adds them, the model gets rows for them. The
    old tokens' logits stay as they were; a new token's embedding and head row start at the mean of the old ones
    (so its logit is the mean of the old logits); the resized model trains, generates, and saves and loads back."""
    folder = FIXTURE.parent / fixture
    model = AutoModelForCausalLM.from_pretrained(folder)
    vocab = model.config.vocab_size
    before = model(IDS).logits.numpy()
    model.resize_token_embeddings(vocab + 3, pad_to_multiple_of=4)
    rows = -(-(vocab + 3) // 4) * 4
    assert model.config.vocab_size == rows and model.get_input_embeddings().weight.shape[0] == rows
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == (fixture == "gpt2")
    after = model(IDS).logits.numpy()
    assert after.shape[-1] == rows
    np.testing.assert_allclose(after[..., :vocab], before, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(after[..., vocab:], np.repeat(before.mean(-1, keepdims=True), rows - vocab, -1),
                               rtol=1e-4, atol=1e-4)
    new_ids = np.array([[1, vocab, 5, vocab + 2]])
    model.train()
    out = model(new_ids, labels=new_ids)
    out.loss.backward()
    grad = model.get_input_embeddings().weight.grad.numpy()
    assert grad.shape[0] == rows and np.abs(grad[vocab]).sum() > 0
    model.eval()
    assert model.generate(new_ids, max_new_tokens=3).shape == (1, 7)
    model.save_pretrained(tmp_path / "resized")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "resized")
    np.testing.assert_array_equal(again(new_ids).logits.numpy(), model(new_ids).logits.numpy())
    with pytest.raises(VkformersError, match="new_num_tokens must be a whole number >= 1"):
        model.resize_token_embeddings(0)
    with pytest.raises(VkformersError, match="pad_to_multiple_of must be a whole number >= 1"):
        model.resize_token_embeddings(rows, pad_to_multiple_of=0)


def test_model_to_a_dtype_as_transformers(checkpoint):
    """model.to(dtype), .half(), .bfloat16(), .float(): the weights as from_pretrained(dtype=...) loads them (LoRA
    adapters stay float32); a device other than the Vulkan one is refused in one line."""
    from vkformers.training import LoraConfig, get_peft_model
    want = AutoModelForCausalLM.from_pretrained(checkpoint, dtype="bfloat16")(IDS).logits.numpy()
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert model.to("bfloat16") is model and model.dtype.name == "bfloat16"
    np.testing.assert_array_equal(model(IDS).logits.numpy(), want)

    class TorchHalf:  # str() of torch.float16
        def __str__(self):
            return "torch.float16"
    assert model.to("vulkan", TorchHalf()).dtype.name == "float16" and model.half().dtype.name == "float16"
    assert {t.dtype.name for t in model.parameters()} == {"float16"}
    assert model.float().dtype.name == "float32" and {t.dtype.name for t in model.parameters()} == {"float32"}
    with pytest.raises(VkformersError, match=r"to\('cuda'\): vkformers runs every model on the Vulkan device"):
        model.to("cuda")
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])).bfloat16()
    dtypes = {n: t.dtype.name for n, t in model.named_parameters()}
    assert {d for n, d in dtypes.items() if ".lora_" in n} == {"float32"}
    assert {d for n, d in dtypes.items() if ".lora_" not in n} == {"bfloat16"}
    model(IDS).logits.numpy()  # runs with bfloat16 weights and float32 adapters


def test_resize_token_embeddings_elsewhere_is_refused_by_name():
    from vkformers import AutoModelForMaskedLM
    model = AutoModelForMaskedLM.from_pretrained(FIXTURE.parent / "encoders" / "bert")
    with pytest.raises(VkformersError, match="resize_token_embeddings is not supported for this architecture"):
        model.resize_token_embeddings(100)
