"""PyTorch pickled checkpoints (pytorch_model.bin, sharded or not, .pt/.pth) read without torch and without running
anything from the file (models/torch_pickle.py): the files in tests/fixtures/torch_pickle were written by torch.save
(tools/make_torch_pickle_fixtures.py); each loads bit for bit as the same weights from safetensors do. Crafted
files (a pickle calling os.system, the legacy format, TorchScript, compressed or truncated storages) are refused
with a CheckpointError, and the os.system call is shown not to have run."""
import json
import pickle
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
from fake_hub import FakeHub

import vkformers
from vkformers import AutoModelForCausalLM
from vkformers.models.loading import HUB_PATTERNS, HUB_PICKLE_PATTERNS, read_weights, resolve_checkpoint, weight_files
from vkformers.models.module import CheckpointError
from vkformers.models.safetensors_io import read_safetensors, write_safetensors
from vkformers.models.torch_pickle import read_torch_checkpoint
from vkformers.runtime import dtypes as dt

FIXTURES = Path(__file__).parent / "fixtures"
PICKLED = FIXTURES / "torch_pickle"
LLAMA = FIXTURES / "llama"
BERT = FIXTURES / "cross_encoder" / "bert-reranker"
IDS = np.array([[1, 5, 9, 2, 7]])


def llama_weights() -> dict:
    return {k: e.as_float() for k, e in read_safetensors(LLAMA / "model.safetensors").items()}


def logits(folder, dtype="float32"):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)(IDS).logits.numpy()


def test_views_and_dtypes_read_as_torch_saved_them():
    """Every dtype a state dict holds, views of one storage (a transpose, row and column slices at storage
    offsets), a scalar, an empty tensor and a Parameter: the same codes, shapes and bytes as safetensors holds
    them; bfloat16 handed to a bfloat16 model as its bits, as from safetensors."""
    got = read_torch_checkpoint(PICKLED / "tensors.pt")
    want = read_safetensors(PICKLED / "tensors.safetensors")
    assert sorted(got) == sorted(want) and len(want) == 17
    for name, expected in want.items():
        entry, weight = got[name], got[name].weight()
        assert (entry.code, weight.shape) == (expected.code, expected.array.shape), name
        value = weight.read()
        assert value.flags.c_contiguous and value.dtype == expected.as_float().dtype, name
        assert value.tobytes() == expected.as_float().tobytes(), name
    assert got["transposed"].array.strides == (4, 24) and np.shares_memory(got["transposed"].array,
                                                                            got["weight"].array)
    weight = got["weight"].as_float()
    for view, expected in (("transposed", weight.T), ("rows", weight[1:3]), ("column", weight[:, 2])):
        np.testing.assert_array_equal(got[view].as_float(), expected)
    bits = got["bfloat16"].weight().read_bfloat16()
    assert bits.dtype == np.uint16 and bits.tobytes() == want["bfloat16"].weight().read_bfloat16().tobytes()
    assert got["float8"].as_float().tolist() == [0.5, -448.0, 3.0]
    assert got["long"].as_float().tolist() == [-(2 ** 40), 0, 7, 2 ** 62]


def test_tied_llama_bin_loads_as_its_safetensors(tmp_path):
    """transformers' pytorch_model.bin of a tied Llama (lm_head.weight and embed_tokens sharing one storage):
    the logits of the same weights from model.safetensors, bit for bit, in float32 and bfloat16."""
    folder = PICKLED / "llama_tied"
    assert weight_files(folder) == [folder / "pytorch_model.bin"]
    reference = tmp_path / "safetensors"
    reference.mkdir()
    shutil.copy(folder / "config.json", reference)
    write_safetensors(reference / "model.safetensors",
                      {k: v for k, v in llama_weights().items() if k != "lm_head.weight"})
    for dtype in ("float32", "bfloat16"):
        np.testing.assert_array_equal(logits(folder, dtype), logits(reference, dtype))
    weights = read_weights(folder)
    np.testing.assert_array_equal(weights["lm_head.weight"], llama_weights()["model.embed_tokens.weight"])


def test_sharded_bfloat16_bin_loads_as_its_safetensors(tmp_path):
    """Two bfloat16 shards and pytorch_model.bin.index.json: the weights of a bfloat16 model.safetensors, bit for
    bit, and its logits loaded in float32 and in bfloat16."""
    folder = PICKLED / "llama_sharded_bf16"
    assert [f.name for f in weight_files(folder)] == ["pytorch_model-00001-of-00002.bin",
                                                      "pytorch_model-00002-of-00002.bin"]
    reference = tmp_path / "safetensors"
    reference.mkdir()
    shutil.copy(LLAMA / "config.json", reference)
    arrays = {k: dt.to_bfloat16(v) for k, v in llama_weights().items()}
    write_safetensors(reference / "model.safetensors", arrays, bfloat16=set(arrays))
    pickled = read_weights(folder)
    assert sorted(pickled) == sorted(arrays)
    for name in arrays:
        assert pickled.read_for(name, dt.bfloat16).tobytes() == arrays[name].tobytes(), name
    for dtype in ("float32", "bfloat16"):
        np.testing.assert_array_equal(logits(folder, dtype), logits(reference, dtype))


def sentence_folder(root: Path, weights: str) -> Path:
    """A sentence-transformers folder of the tiny BERT (Transformer, mean Pooling, Dense 32 -> 8, Normalize),
    its weights from torch.save ("pickled") or safetensors."""
    folder = root / weights
    (folder / "1_Pooling").mkdir(parents=True)
    (folder / "2_Dense").mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "sentence_bert_config.json"):
        shutil.copy(BERT / name, folder)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True}))
    shutil.copy(PICKLED / "dense" / "config.json", folder / "2_Dense")
    if weights == "pickled":
        shutil.copy(PICKLED / "bert" / "pytorch_model.bin", folder)
        shutil.copy(PICKLED / "dense" / "pytorch_model.bin", folder / "2_Dense")
    else:
        shutil.copy(BERT / "model.safetensors", folder)
        shutil.copy(PICKLED / "dense.safetensors", folder / "2_Dense" / "model.safetensors")
    types = ("Transformer", "Pooling", "Dense", "Normalize")
    paths = ("", "1_Pooling", "2_Dense", "3_Normalize")
    (folder / "modules.json").write_text(json.dumps(
        [{"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{t}"}
         for i, (t, p) in enumerate(zip(types, paths))]))
    return folder


def test_sentence_transformer_from_pytorch_model_bin(tmp_path):
    """A sentence-transformers folder whose Transformer and Dense modules hold only pytorch_model.bin embeds as
    the same folder with safetensors does, bit for bit."""
    texts = ["a tiny test", "the second text is a little longer than the first", "x"]
    pickled = vkformers.SentenceTransformer(sentence_folder(tmp_path, "pickled")).encode(texts)
    reference = vkformers.SentenceTransformer(sentence_folder(tmp_path, "safetensors")).encode(texts)
    assert pickled.shape == (3, 8)
    np.testing.assert_array_equal(pickled, reference)


def write_zip(path: Path, members: dict, compression=zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(path, "w", compression) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def members_of(path: Path) -> dict:
    with zipfile.ZipFile(path) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def test_a_pickle_naming_os_system_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "ran"
    command = f"touch {marker}".encode()
    # protocol 2: GLOBAL os.system, its argument, REDUCE (call it), STOP
    payload = (b"\x80\x02cos\nsystem\nq\x00X" + len(command).to_bytes(4, "little") + command
               + b"q\x01\x85q\x02Rq\x03.")
    folder = tmp_path / "model"
    folder.mkdir()
    write_zip(folder / "pytorch_model.bin", {"archive/data.pkl": payload, "archive/byteorder": b"little",
                                             "archive/version": b"3\n"})
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin: .*objects other than tensors.*os\.system"):
        read_weights(folder)
    assert not marker.exists()
    pickle.loads(payload)  # the standard unpickler runs it: the file was armed
    assert marker.exists()


def test_legacy_torchscript_compressed_and_truncated_files_are_refused(tmp_path):
    legacy = tmp_path / "legacy.pt"  # torch < 1.6: a pickled magic number, then pickles and raw storages
    legacy.write_bytes(b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19.\x80\x02M\xe9\x03.")
    with pytest.raises(CheckpointError, match=r"legacy.pt: not a zip checkpoint of torch >= 1.6.*re-save"):
        read_torch_checkpoint(legacy)
    saved = members_of(PICKLED / "tensors.pt")
    scripted = write_zip(tmp_path / "scripted.pt", {**saved, "tensors/constants.pkl": b"\x80\x02)."})
    with pytest.raises(CheckpointError, match="a TorchScript archive, not a state dict"):
        read_torch_checkpoint(scripted)
    compressed = write_zip(tmp_path / "compressed.pt", saved, zipfile.ZIP_DEFLATED)
    with pytest.raises(CheckpointError, match=r"compressed.pt: storage \d+ is compressed"):
        read_torch_checkpoint(compressed)
    truncated = write_zip(tmp_path / "truncated.pt", {**saved, "tensors/data/0": saved["tensors/data/0"][:-8]})
    with pytest.raises(CheckpointError, match=r"truncated.pt: storage 0 is shorter than its \d+ elements"):
        read_torch_checkpoint(truncated)
    not_tensors = write_zip(tmp_path / "numbers.pt", {"archive/data.pkl": pickle.dumps({"epoch": 3}, protocol=2)})
    with pytest.raises(CheckpointError, match=r"numbers.pt: not a state dict"):
        read_torch_checkpoint(not_tensors)


def test_which_weight_files_a_folder_gives(tmp_path):
    """safetensors first, as transformers; else pytorch_model.bin, else the one .bin/.pt/.pth; several unnamed
    ones are refused."""
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(LLAMA / "config.json", folder)
    shutil.copy(PICKLED / "llama_tied" / "pytorch_model.bin", folder / "weights.pth")
    assert weight_files(folder) == [folder / "weights.pth"]
    shutil.copy(PICKLED / "tensors.pt", folder)
    with pytest.raises(CheckpointError, match=r"several PyTorch weight files \(tensors.pt, weights.pth\)"):
        weight_files(folder)
    (folder / "pytorch_model.bin").write_bytes(b"not read")
    assert weight_files(folder) == [folder / "pytorch_model.bin"]
    shutil.copy(LLAMA / "model.safetensors", folder)
    assert weight_files(folder) == [folder / "model.safetensors"]
    np.testing.assert_array_equal(logits(folder), logits(LLAMA))


@pytest.mark.parametrize("weights", ["safetensors", "pickled"])
def test_a_hub_repo_with_only_pickled_weights_is_fetched(tmp_path, monkeypatch, weights):
    """The .bin files are fetched in a second download only where the repo has no safetensors weights."""
    source = LLAMA if weights == "safetensors" else PICKLED / "llama_tied"
    weight_file = weight_files(source)[0]
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(source / "config.json", repo)
    shutil.copy(weight_file, repo)
    (repo / "training_args.bin").write_bytes(b"never fetched")
    hub = FakeHub(tmp_path, {"someone/tiny-llama": repo})
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.snapshot_download", hub)
    resolve_checkpoint("someone/tiny-llama")
    assert [call["allow_patterns"] for call in hub.calls] == (
        [HUB_PATTERNS] if weights == "safetensors" else [HUB_PATTERNS, HUB_PICKLE_PATTERNS])
    assert hub.fetched("someone/tiny-llama") == ["config.json", weight_file.name]
    np.testing.assert_array_equal(logits("someone/tiny-llama"), logits(source))
