"""PEFT LoRA adapters from a hub repo id, as ``PeftModel.from_pretrained(base, "org/some-lora")`` and vLLM's
``--lora-modules name=org/some-lora`` take them (models/lora.py's resolve_adapter over models/hub.py).

No network: ``huggingface_hub.snapshot_download`` is replaced by one that copies, from a folder standing for the
repo, the files its allow patterns select into a snapshot folder of a temporary cache, as the real one does. The
adapters are the llama_lora fixture (safetensors) and the same adapter torch.save'd (adapter_model.bin only); what
loads from the "hub" must give, bit for bit, what loads from the fixture's folder.
"""
import shutil
from pathlib import Path

import numpy as np
import pytest

from fake_hub import FakeHub
from test_decoder_parity import FIXTURES
from vkformers.cli import main
from vkformers.cli import serve as cli_serve
from vkformers.engine.tensor import tensor
from vkformers.errors import VkformersError
from vkformers.models.hub import HubError
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.models.lora import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, PICKLED_ADAPTER_WEIGHTS, LoraError, LoraLinear,
                                   PeftModel, check_adapter_folder, load_adapter, resolve_adapter, serve_adapters)
from vkformers.models.safetensors_io import read_safetensors

ADAPTER = FIXTURES / "llama_lora"
PICKLED_ADAPTER = FIXTURES / "torch_pickle" / "llama_lora"
pytestmark = pytest.mark.skipif(not (ADAPTER / ADAPTER_WEIGHTS).is_file() or
                                not (PICKLED_ADAPTER / PICKLED_ADAPTER_WEIGHTS).is_file(),
                                reason="no llama_lora fixtures")
IDS = np.array([[1, 5, 9, 2, 7, 30, 4]], np.int32)
ADAPTER_PATTERNS = [ADAPTER_CONFIG, ADAPTER_WEIGHTS]


def base_llama():
    return AutoModelForCausalLM.from_pretrained(FIXTURES / "llama", dtype="float32", requires_grad=False)


def repo_of(folder: Path, root: Path, inside: str = "") -> Path:
    """A repo holding ``folder``'s adapter files (under ``inside``) and files an adapter never needs."""
    root.mkdir(parents=True)
    (root / inside).mkdir(parents=True, exist_ok=True)
    for file in folder.iterdir():
        if file.name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS, PICKLED_ADAPTER_WEIGHTS):
            shutil.copy(file, root / inside / file.name)
    (root / "README.md").write_text("an adapter card")
    (root / "training_args.bin").write_bytes(b"never fetched")
    (root / "checkpoint-10").mkdir()
    shutil.copy(folder / ADAPTER_CONFIG, root / "checkpoint-10")  # a nested adapter, fetched only by subfolder
    return root


@pytest.fixture
def hub(tmp_path, monkeypatch):
    repos = {"org/lora": repo_of(ADAPTER, tmp_path / "repos" / "lora"),
             "org/old-lora": repo_of(PICKLED_ADAPTER, tmp_path / "repos" / "old-lora"),
             "org/many": repo_of(ADAPTER, tmp_path / "repos" / "many", inside="sql")}
    fake = FakeHub(tmp_path, repos)
    import huggingface_hub.constants as constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the fake serves what an online hub would
    monkeypatch.setattr("huggingface_hub.snapshot_download", fake)
    return fake


@pytest.fixture(scope="module")
def expected():
    logits = load_adapter(base_llama(), ADAPTER)(IDS).logits.numpy()
    assert np.abs(logits - base_llama()(IDS).logits.numpy()).max() > 0.1  # the adapter changes the logits
    return logits


def test_a_hub_adapter_loads_as_its_folder_bit_for_bit(hub, expected):
    """PeftModel.from_pretrained, load_adapter and from_pretrained(adapter=) each fetch adapter_config.json and
    adapter_model.safetensors alone (one download: the repo has safetensors), and give the folder's logits."""
    np.testing.assert_array_equal(PeftModel.from_pretrained(base_llama(), "org/lora")(IDS).logits.numpy(), expected)
    np.testing.assert_array_equal(load_adapter(base_llama(), "org/lora")(IDS).logits.numpy(), expected)
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / "llama", dtype="float32", adapter="org/lora")
    np.testing.assert_array_equal(model(IDS).logits.numpy(), expected)
    assert [(c["repo_id"], c["allow_patterns"]) for c in hub.calls] == [("org/lora", ADAPTER_PATTERNS)] * 3
    assert hub.fetched("org/lora") == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    assert check_adapter_folder("org/lora").r == 4


def test_a_repo_with_only_adapter_model_bin_is_fetched_in_a_second_download(hub, expected):
    model = PeftModel.from_pretrained(base_llama(), "org/old-lora")
    assert [c["allow_patterns"] for c in hub.calls] == [ADAPTER_PATTERNS, [PICKLED_ADAPTER_WEIGHTS]]
    assert hub.fetched("org/old-lora") == [ADAPTER_CONFIG, PICKLED_ADAPTER_WEIGHTS]
    np.testing.assert_array_equal(model(IDS).logits.numpy(), expected)


def test_revision_token_cache_and_local_files_only_reach_the_download(hub, tmp_path, expected):
    PeftModel.from_pretrained(base_llama(), "org/lora", revision="v1.0", token="hf_secret",
                              cache_dir=tmp_path / "mine", local_files_only=True)
    assert hub.calls[-1] == dict(repo_id="org/lora", allow_patterns=ADAPTER_PATTERNS, revision="v1.0",
                                 cache_dir=tmp_path / "mine", token="hf_secret", local_files_only=True)
    # from_pretrained: the base's token, cache and local_files_only; adapter_kwargs (transformers' name) its own
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / "llama", dtype="float32", adapter="org/lora",
                                                 token="hf_base", adapter_kwargs={"revision": "v2"})
    assert hub.calls[-1] == dict(repo_id="org/lora", allow_patterns=ADAPTER_PATTERNS, revision="v2",
                                 cache_dir=None, token="hf_base", local_files_only=False)
    np.testing.assert_array_equal(model(IDS).logits.numpy(), expected)
    calls = len(hub.calls)
    with pytest.raises(VkformersError, match=r"adapter_kwargs=\{'force_download': \.\.\.\}: the adapter's "
                                                   r"hub options are subfolder, revision, token"):
        AutoModelForCausalLM.from_pretrained(FIXTURES / "llama", adapter="org/lora",
                                             adapter_kwargs={"force_download": True})
    assert len(hub.calls) == calls  # refused before anything is fetched or loaded


def test_an_adapter_in_a_subfolder_as_peft_subfolder(hub, tmp_path, expected):
    """PEFT's subfolder=: only the subfolder's adapter files are fetched; a local folder's subfolder reads the same."""
    model = PeftModel.from_pretrained(base_llama(), "org/many", subfolder="sql")
    assert hub.calls[-1]["allow_patterns"] == ["sql/" + ADAPTER_CONFIG, "sql/" + ADAPTER_WEIGHTS]
    assert hub.fetched("org/many") == ["sql/" + ADAPTER_CONFIG, "sql/" + ADAPTER_WEIGHTS]
    np.testing.assert_array_equal(model(IDS).logits.numpy(), expected)
    calls = len(hub.calls)
    local = PeftModel.from_pretrained(base_llama(), hub.repos["org/many"], subfolder="sql")
    np.testing.assert_array_equal(local(IDS).logits.numpy(), expected)
    assert len(hub.calls) == calls  # a folder that exists is never looked up on the hub


def test_an_offline_miss_is_a_one_line_hub_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model = base_llama()
    with pytest.raises(HubError) as caught:
        load_adapter(model, "org/missing-lora", cache_dir=tmp_path / "hub-cache")
    message = str(caught.value)
    assert message.startswith("adapter 'org/missing-lora' offline (HF_HUB_OFFLINE is set) and it is not in the "
                              f"cache {tmp_path / 'hub-cache'}: ") and "\n" not in message
    assert not any(isinstance(m, LoraLinear) for _, m in model.named_modules())  # the model is left as it was


@pytest.mark.parametrize("name", ["./no-such-lora", "~/no-such-lora", "runs/lora/final"])
def test_a_missing_folder_written_as_a_path_keeps_its_error_and_asks_no_hub(hub, name):
    with pytest.raises(LoraError, match=r"no-such-lora|runs/lora/final"):
        load_adapter(base_llama(), name)
    with pytest.raises(LoraError, match=r": no adapter_config.json \(not a PEFT adapter folder\)"):
        check_adapter_folder(name)
    assert resolve_adapter(name) == Path(name).expanduser().absolute()
    assert hub.calls == []


def test_merge_lora_of_a_hub_adapter_saves_what_its_folder_gives(hub, tmp_path, capsys):
    """``vkformers merge-lora --adapter org/lora`` end to end: the merged weights are bit for bit those merged from
    the folder (what ``generate --adapter`` and ``serve --adapter`` do at load too)."""
    merged = {}
    for name, adapter in (("hub", "org/lora"), ("folder", str(ADAPTER))):
        assert main(["merge-lora", "--model", str(FIXTURES / "llama"), "--adapter", adapter,
                     "--out", str(tmp_path / name), "--dtype", "float32"]) == 0
        merged[name] = {k: e.as_float() for k, e in read_safetensors(tmp_path / name / "model.safetensors").items()}
    assert "merged org/lora into" in capsys.readouterr().out
    assert [c["repo_id"] for c in hub.calls] == ["org/lora"]  # fetched once, before the model loads
    assert sorted(merged["hub"]) == sorted(merged["folder"])
    for key, array in merged["folder"].items():
        np.testing.assert_array_equal(merged["hub"][key], array, err_msg=key)


@pytest.mark.parametrize("command", ["generate", "serve", "merge-lora"])
def test_a_hub_adapter_that_cannot_be_fetched_stops_the_command_before_the_model_loads(hub, tmp_path, capsys,
                                                                                      command):
    import socket
    extra = {"generate": ["--prompt", "hi"], "merge-lora": ["--out", str(tmp_path / "merged")]}.get(command, [])
    if command == "serve":
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            extra = ["--port", str(probe.getsockname()[1]), "--adapter", "sql=org/lora"]
    model = ["--model", str(tmp_path / "no-model")] if command != "serve" else []
    assert main([command, *model, "--adapter", "org/missing-lora", *extra]) == 1
    assert capsys.readouterr().err.startswith(f"vkformers {command}: error: adapter 'org/missing-lora' could not be "
                                              "fetched into the cache ")
    assert not (tmp_path / "merged").exists()


def test_adapters_served_by_name_from_the_hub_as_from_their_folders(hub):
    """``serve --adapter sql=org/lora`` (serve_adapters): a row taking the hub adapter gets the logits of a row taking
    the same adapter's folder, and those of the adapter loaded alone."""
    model = base_llama()
    selector = serve_adapters(model, {"folder": ADAPTER, "hub": "org/lora", "old": "org/old-lora"})
    with selector.selecting(tensor(selector.row_scales([1, 2, 3]))):
        logits = model(np.concatenate([IDS, IDS, IDS])).logits.numpy()
    np.testing.assert_array_equal(logits[1], logits[0])
    np.testing.assert_array_equal(logits[2], logits[0])
    # alone, the row may take another product kernel than in a batch of three (on a GPU)
    alone = load_adapter(base_llama(), ADAPTER)(IDS).logits.numpy()[0]
    np.testing.assert_allclose(logits[0], alone, rtol=0, atol=1e-5 * np.abs(alone).max())
    assert cli_serve.adapter_options(["sql=org/lora"]) == (None, {"sql": "org/lora"})
