"""push_to_hub, as transformers and PEFT users call it: a model, its tokenizer or its LoRA adapter uploaded to a hub
repo in one commit (created where missing), and ``vkformers train --push-to-hub``. A fake hub (tests/fake_hub.py)
stands in for the network: what is pushed is read back through from_pretrained."""
import json

import numpy as np
import pytest
from fake_hub import FakeHub, FakeHubApi

from vkformers.cli import main
from vkformers.models.hub import HubError
from vkformers.models.loading import AutoModelForCausalLM, AutoTokenizer
from vkformers.training import LoraConfig, apply_lora, init_weights

from test_lora import tiny_llama_folder
from test_tokenizer import write_tokenizer

IDS = np.array([[5, 9, 12, 3]])


@pytest.fixture
def hub(tmp_path, monkeypatch):
    fake = FakeHub(tmp_path, {})
    api = FakeHubApi(fake, tmp_path / "repos")
    import huggingface_hub.constants as constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.snapshot_download", fake)
    monkeypatch.setattr("huggingface_hub.HfApi", api)
    return api


def tiny_llama(tmp_path):
    pytest.importorskip("vkformers_llama")
    model = AutoModelForCausalLM.from_config(json.loads((tiny_llama_folder(tmp_path / "tiny") / "config.json")
                                                        .read_text()))
    init_weights(model, seed=1)
    return model


def test_a_model_and_its_tokenizer_pushed_load_back_the_same(hub, tmp_path):
    model = tiny_llama(tmp_path)
    commit = model.push_to_hub("org/tiny", private=True, token="write")
    assert commit.commit_url == "https://huggingface.co/org/tiny/commit/1"
    assert hub.calls[0] == ("create_repo", "org/tiny", {"private": True, "exist_ok": True, "token": "write"})
    assert hub.calls[1][2]["files"] == ["config.json", "generation_config.json", "model.safetensors"]
    assert hub.calls[1][2]["commit_message"] == "Upload llama"
    tokenizer = AutoTokenizer.from_pretrained(write_tokenizer(tmp_path / "tok"))
    tokenizer.push_to_hub("org/tiny", commit_message="the tokenizer")
    assert hub.calls[3][2]["commit_message"] == "the tokenizer"
    again = AutoModelForCausalLM.from_pretrained("org/tiny", dtype="float32")
    np.testing.assert_array_equal(again(IDS).logits.numpy(), model(IDS).logits.numpy())
    pushed = AutoTokenizer.from_pretrained("org/tiny")
    assert pushed("hello world")["input_ids"] == tokenizer("hello world")["input_ids"]


def test_a_lora_model_pushes_its_adapter_as_peft_does(hub, tmp_path):
    model = tiny_llama(tmp_path)
    apply_lora(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]), seed=0)
    model.push_to_hub("org/adapter")
    upload = hub.calls[1][2]
    assert (upload["files"], upload["commit_message"]) == (["adapter_config.json", "adapter_model.safetensors"],
                                                           "Upload adapter")


def test_a_token_that_cannot_write_is_a_hub_error(hub, tmp_path):
    model = tiny_llama(tmp_path)
    with pytest.raises(HubError, match=r"could not push to the hub repo 'org/tiny': PermissionError: 403 .*HF_TOKEN"):
        model.push_to_hub("org/tiny", token="read-only")


def test_train_pushes_final_and_checks_the_repo_before_training(hub, tmp_path, capsys):
    pytest.importorskip("vkformers_llama")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question. " * 40)
    common = ["train", "--model", str(tiny_llama_folder(tmp_path / "config")), "--from-scratch", "--tokenizer", "byte",
              "--data", str(corpus), "--steps", "2", "--seq-len", "16", "--no-progress", "--eval-fraction", "0"]
    assert main([*common, "--out", str(tmp_path / "refused"), "--push-to-hub", "org/run", "--hub-token",
                 "read-only"]) == 1
    assert "could not push to the hub repo 'org/run'" in capsys.readouterr().err
    assert not (tmp_path / "refused" / "checkpoints").exists()  # stopped before training
    assert main([*common, "--out", str(tmp_path / "run"), "--push-to-hub", "org/run", "--hub-private"]) == 0
    assert "pushed" in capsys.readouterr().out
    create, upload = hub.calls[-2:]
    assert create[2]["private"] is True and upload[2]["commit_message"].startswith("vkformers train: step 2, loss ")
    final = tmp_path / "run" / "final"
    assert upload[2]["files"] == sorted(p.name for p in final.iterdir())
    np.testing.assert_array_equal(AutoModelForCausalLM.from_pretrained("org/run", dtype="float32")(IDS).logits.numpy(),
                                  AutoModelForCausalLM.from_pretrained(final, dtype="float32")(IDS).logits.numpy())


def test_merge_lora_pushes_the_merged_model(hub, tmp_path, capsys):
    model = tiny_llama(tmp_path)
    model.save_pretrained(tmp_path / "base")
    apply_lora(model, LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False), seed=0)
    model.save_pretrained(tmp_path / "adapter")
    assert main(["merge-lora", "--model", str(tmp_path / "base"), "--adapter", str(tmp_path / "adapter"), "--out",
                 str(tmp_path / "merged"), "--dtype", "float32", "--push-to-hub", "org/merged"]) == 0
    assert "pushed" in capsys.readouterr().out
    assert hub.calls[0][0] == "create_repo" and hub.calls[-1][2]["commit_message"].startswith("merge ")
    pushed = AutoModelForCausalLM.from_pretrained("org/merged", dtype="float32")(IDS).logits.numpy()
    np.testing.assert_allclose(pushed, model(IDS).logits.numpy(), rtol=0, atol=1e-5)
