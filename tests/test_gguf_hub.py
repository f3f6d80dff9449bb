"""GGUF models as users fetch them: split into parts by llama.cpp's gguf-split, and one file of a hub repo
(transformers' ``from_pretrained(repo, gguf_file=NAME)``; the CLI's ``--model org/repo:QUANT`` and ``--gguf-file``).

The split parts are written here, into tmp_path, from the llama Q8_0 fixture (tests/data/gguf: Q8_0, F16 and F32
tensors) by the gguf package's GGUFWriter, which splits as gguf-split does: ``split.no``, ``split.count`` and
``split.tensors.count`` in every part, the other metadata in the first, each part its own tensors and data. Loaded
from any part, the split model must give the whole file's logits bit for bit.

No network: ``huggingface_hub.snapshot_download`` is tests/fake_hub.py's FakeHub (the files its allow patterns select
copied into a snapshot folder) and ``list_repo_files`` lists the folder standing for the repo.
"""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from fake_hub import FakeHub
from vkformers.cli import main
from vkformers.cli.serve import served_name
from vkformers.engine.quantized import QuantizedArray
from vkformers.errors import VkformersError
from vkformers.models import gguf as vkgguf
from vkformers.models.hub import HubError
from vkformers.models.loading import AutoModelForCausalLM, AutoTokenizer
from vkformers.models.module import CheckpointError

gguf = pytest.importorskip("gguf", reason=vkgguf.INSTALL_HINT)

SOURCE = Path(__file__).parent / "data" / "gguf" / "llama.Q8_0.gguf"  # 21 tensors, a 48-token vocabulary
IDS = np.array([[1, 5, 9, 2, 7, 30, 4, 47]], np.int32)
PART_NAMES = [f"Model-Q8_0-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]


def write_split(source: Path, path: Path, max_tensors: int, *, small_first_shard: bool = False) -> list[Path]:
    """``source`` split into parts of at most ``max_tensors`` tensors, named after ``path``; ``small_first_shard``:
    the first part holds the metadata alone (gguf-split's --no-tensor-first-split)."""
    reader = gguf.GGUFReader(str(source))
    meta = vkgguf.read_metadata(reader)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), meta["general.architecture"], split_max_tensors=max_tensors,
                             small_first_shard=small_first_shard)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, meta[key], field.types[0], sub_type)
    for tensor in reader.tensors:  # the blocks as they are
        writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))


def logits(path, **options) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32", requires_grad=False, **options)
    return model(IDS).logits.numpy()


@pytest.fixture(scope="module")
def whole_logits():
    return logits(SOURCE)


@pytest.fixture
def parts(tmp_path):
    return write_split(SOURCE, tmp_path / "split" / "Model-Q8_0.gguf", 8)


# -- split GGUF -------------------------------------------------------------------------------------------------
def test_the_split_keys_are_those_gguf_split_writes(parts):
    assert [p.name for p in parts] == PART_NAMES
    metas = [vkgguf.read_metadata(gguf.GGUFReader(str(p))) for p in parts]
    assert [(m["split.no"], m["split.count"], m["split.tensors.count"]) for m in metas] == [(0, 3, 21), (1, 3, 21),
                                                                                        (2, 3, 21)]
    assert metas[0]["llama.block_count"] == 2 and "llama.block_count" not in metas[1]  # metadata in the first alone
    assert [len(gguf.GGUFReader(str(p)).tensors) for p in parts] == [8, 8, 5]
    assert vkgguf.split_part_names("sub/Model-Q8_0-00002-of-00003.gguf") == [f"sub/{n}" for n in PART_NAMES]
    assert vkgguf.split_part_names("model.Q8_0.gguf") == ["model.Q8_0.gguf"]


@pytest.mark.parametrize("part", [0, 1, 2])
def test_any_part_loads_every_part_bit_for_bit(parts, part, whole_logits):
    assert vkgguf.gguf_parts(parts[part]) == parts
    np.testing.assert_array_equal(logits(parts[part]), whole_logits)
    config, weights, tokenizer = vkgguf.load_gguf(parts[part], dequantize=False)
    want_config, want, want_tokenizer = vkgguf.load_gguf(SOURCE, dequantize=False)
    assert config == want_config and sorted(weights) == sorted(want)
    for name, array in want.items():
        if isinstance(array, QuantizedArray):  # the Q8_0 blocks, as the file stores them
            assert weights[name].format == array.format
            np.testing.assert_array_equal(weights[name].packed, array.packed)
        else:
            np.testing.assert_array_equal(weights[name], array)
    assert tokenizer.get_vocab() == want_tokenizer.get_vocab() and tokenizer.bos_token == want_tokenizer.bos_token


def test_a_first_part_of_metadata_alone_and_dequantized_loads(tmp_path, whole_logits):
    """gguf-split's --no-tensor-first-split: the first part has no tensor."""
    parts = write_split(SOURCE, tmp_path / "Model-Q8_0.gguf", 12, small_first_shard=True)
    assert [len(gguf.GGUFReader(str(p)).tensors) for p in parts] == [0, 12, 9]
    np.testing.assert_array_equal(logits(parts[0]), whole_logits)
    np.testing.assert_array_equal(logits(parts[1], dequantize=True), logits(SOURCE, dequantize=True))


def test_a_missing_part_is_named(parts):
    parts[1].unlink()
    for given in (parts[0], parts[2]):
        with pytest.raises(CheckpointError, match=r"Model-Q8_0-00002-of-00003\.gguf is missing from") as error:
            AutoModelForCausalLM.from_pretrained(given)
        assert "\n" not in str(error.value)
    # the tokenizer reads the first part alone
    assert AutoTokenizer.from_pretrained(parts[2]).get_vocab() == AutoTokenizer.from_pretrained(SOURCE).get_vocab()
    parts[0].unlink()
    with pytest.raises(CheckpointError, match=r"00001-of-00003\.gguf, Model-Q8_0-00002-of-00003\.gguf are missing"):
        vkgguf.gguf_parts(parts[2])
    with pytest.raises(CheckpointError, match="no such GGUF file"):
        AutoTokenizer.from_pretrained(parts[2])


def test_parts_of_another_split_or_renamed_are_refused(parts, tmp_path):
    other = write_split(SOURCE, tmp_path / "other" / "Model-Q8_0.gguf", 9)  # 9 + 9 + 3 tensors
    shutil.copy(other[2], parts[2])
    with pytest.raises(CheckpointError, match="split.tensors.count says 21 tensors, the 3 parts hold 19"):
        AutoModelForCausalLM.from_pretrained(parts[0])
    shutil.copy(other[1], parts[2])  # part 2 in part 3's place
    with pytest.raises(CheckpointError, match=r"00003-of-00003\.gguf: not part 3 of 3 of this split GGUF "
                                              r"\(split\.no=1, split\.count=3\)"):
        AutoModelForCausalLM.from_pretrained(parts[0])
    renamed = parts[0].with_name("model.gguf")
    parts[0].rename(renamed)
    with pytest.raises(CheckpointError, match=r"part 1 of a GGUF split into 3 files, but not named as gguf-split "
                                              r"names it \(NAME-00001-of-00003\.gguf\)"):
        AutoModelForCausalLM.from_pretrained(renamed)


# -- from a hub repo (gguf_file=) --------------------------------------------------------------------------------
REPO_FILES = ["Model.Q8_0.gguf", "Model.Q4_K_M.gguf", "Model.Q4_K_S.gguf", "Model.Q2_K.gguf", "Model.Q2_K_L.gguf",
              "Model.IQ4_XS.gguf", "mmproj-Model-Q8_0.gguf"]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny llama with a trained byte-level BPE vocabulary (tests/test_gguf.py), whose tokenizer encodes text."""
    from test_gguf import random_llama, train_bpe, write_tiny_gguf
    backend = train_bpe()
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", random_llama(backend.get_vocab_size()),
                           backend, quant="Q8_0")


@pytest.fixture
def hub(tmp_path, monkeypatch, tiny_gguf):
    """org/Model-GGUF: one file per quantization (copies of the fixture), a vision projector and a card;
    org/Split-GGUF: a split Q8_0 in a folder beside a whole F16 file; org/Tiny-GGUF: the tiny BPE model."""
    model = tmp_path / "repos" / "model"
    model.mkdir(parents=True)
    for name in REPO_FILES:
        shutil.copy(SOURCE, model / name)
    (model / "README.md").write_text("a model card")
    split = tmp_path / "repos" / "split"
    write_split(SOURCE, split / "Q8_0" / "Model-Q8_0.gguf", 8)
    shutil.copy(SOURCE, split / "Model-F16.gguf")
    tiny = tmp_path / "repos" / "tiny"
    tiny.mkdir()
    shutil.copy(tiny_gguf, tiny / "tiny.Q8_0.gguf")
    fake = FakeHub(tmp_path, {"org/Model-GGUF": model, "org/Split-GGUF": split, "org/Tiny-GGUF": tiny})
    fake.listed = []

    def list_repo_files(repo_id, *, revision=None, token=None, **unused):
        fake.listed.append((repo_id, revision, token))
        if repo_id not in fake.repos:
            raise FileNotFoundError(f"404: no repo {repo_id}")
        root = fake.repos[repo_id]
        return sorted(f.relative_to(root).as_posix() for f in root.rglob("*") if f.is_file())

    import huggingface_hub.constants as constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the fake serves what an online hub would
    monkeypatch.setattr("huggingface_hub.snapshot_download", fake)
    monkeypatch.setattr("huggingface_hub.list_repo_files", list_repo_files)
    return fake


def test_gguf_file_fetches_that_file_alone(hub, whole_logits):
    np.testing.assert_array_equal(logits("org/Model-GGUF", gguf_file="Model.Q8_0.gguf"), whole_logits)
    assert [(c["repo_id"], c["allow_patterns"]) for c in hub.calls] == [("org/Model-GGUF", ["Model.Q8_0.gguf"])]
    assert hub.fetched("org/Model-GGUF") == ["Model.Q8_0.gguf"]


def test_gguf_file_of_a_split_fetches_every_part(hub, whole_logits):
    first = "Q8_0/" + PART_NAMES[0]
    tokenizer = AutoTokenizer.from_pretrained("org/Split-GGUF", gguf_file=first)  # the metadata: the first part
    assert hub.fetched("org/Split-GGUF") == [first]
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(SOURCE).get_vocab()
    np.testing.assert_array_equal(logits("org/Split-GGUF", gguf_file=first), whole_logits)
    assert hub.calls[-1]["allow_patterns"] == [f"Q8_0/{n}" for n in PART_NAMES]
    assert hub.fetched("org/Split-GGUF") == [f"Q8_0/{n}" for n in PART_NAMES]  # not Model-F16.gguf


def test_the_tokenizer_of_a_hub_gguf_file(hub, tiny_gguf):
    tokenizer = AutoTokenizer.from_pretrained("org/Tiny-GGUF", gguf_file="tiny.Q8_0.gguf", revision="v1",
                                              token="hf_secret", padding_side="left")
    local = AutoTokenizer.from_pretrained(tiny_gguf)
    text = "the capital of france is paris"
    assert tokenizer(text)["input_ids"] == local(text)["input_ids"] and len(local(text)["input_ids"]) > 3
    assert tokenizer.chat_template == local.chat_template and tokenizer.padding_side == "left"
    assert [(c["repo_id"], c["allow_patterns"], c["revision"], c["token"]) for c in hub.calls] == [
        ("org/Tiny-GGUF", ["tiny.Q8_0.gguf"], "v1", "hf_secret")]


def test_a_local_folder_with_gguf_file(hub, parts, whole_logits):
    np.testing.assert_array_equal(logits(parts[0].parent, gguf_file=PART_NAMES[1]), whole_logits)
    np.testing.assert_array_equal(logits(SOURCE.parent, gguf_file=SOURCE.name), whole_logits)
    assert hub.calls == []
    with pytest.raises(CheckpointError, match="no absent.gguf in this folder"):
        AutoModelForCausalLM.from_pretrained(SOURCE.parent, gguf_file="absent.gguf")


def test_gguf_file_errors(hub):
    with pytest.raises(HubError, match=r"hub repo 'org/Model-GGUF' has no Model\.Q5_K_M\.gguf"):
        AutoModelForCausalLM.from_pretrained("org/Model-GGUF", gguf_file="Model.Q5_K_M.gguf")
    (hub.repos["org/Split-GGUF"] / "Q8_0" / PART_NAMES[1]).unlink()  # a part the repo lacks
    with pytest.raises(HubError, match=r"'org/Split-GGUF' has no Q8_0/Model-Q8_0-00002-of-00003\.gguf; check"):
        AutoModelForCausalLM.from_pretrained("org/Split-GGUF", gguf_file="Q8_0/" + PART_NAMES[0])
    with pytest.raises(VkformersError, match="gguf_file names a file inside a folder or hub repo"):
        AutoModelForCausalLM.from_pretrained(SOURCE, gguf_file="Model.Q8_0.gguf")
    for name in ("config.json", "../Model.Q8_0.gguf", "/abs/Model.Q8_0.gguf"):
        with pytest.raises(VkformersError, match="name a .gguf file inside the folder or hub repo"):
            AutoTokenizer.from_pretrained("org/Model-GGUF", gguf_file=name)
    with pytest.raises(HubError, match="'org/absent' could not be fetched"):
        AutoModelForCausalLM.from_pretrained("org/absent", gguf_file="m.gguf")


# -- a file by its quantization tag (llama.cpp's -hf org/repo:QUANT) ------------------------------------------------
@pytest.mark.parametrize("tag, file", [("Q4_K_M", "Model.Q4_K_M.gguf"), ("q8_0", "Model.Q8_0.gguf"),
                                       ("Q2_K", "Model.Q2_K.gguf"), ("q2_k_l", "Model.Q2_K_L.gguf"),
                                       ("IQ4_XS", "Model.IQ4_XS.gguf")])
def test_a_tag_picks_the_file_whose_name_holds_it(hub, tag, file):
    """Any case; mmproj never; of Q2_K and Q2_K_L, Q2_K picks the file where it stands alone."""
    assert vkgguf.gguf_file_of_tag("org/Model-GGUF", tag, revision="v2", token="t") == file
    assert hub.listed == [("org/Model-GGUF", "v2", "t")] and hub.calls == []


def test_a_tag_of_a_split_picks_its_first_part(hub):
    assert vkgguf.gguf_file_of_tag("org/Split-GGUF", "Q8_0") == "Q8_0/" + PART_NAMES[0]


def test_an_ambiguous_or_missing_tag_lists_the_files(hub):
    with pytest.raises(VkformersError, match=r"^org/Model-GGUF:Q4_K: several GGUF files of the repo have 'Q4_K' in "
                                             r"their names \(Model\.Q4_K_M\.gguf, Model\.Q4_K_S\.gguf\)"):
        vkgguf.gguf_file_of_tag("org/Model-GGUF", "Q4_K")
    with pytest.raises(VkformersError, match=r"no GGUF file of the repo has 'Q5_K_M' in its name \(its GGUF files: "
                                             r"Model\.IQ4_XS\.gguf, Model\.Q2_K\.gguf, Model\.Q2_K_L\.gguf, "
                                             r"Model\.Q4_K_M\.gguf, Model\.Q4_K_S\.gguf, Model\.Q8_0\.gguf\)"):
        vkgguf.gguf_file_of_tag("org/Model-GGUF", "Q5_K_M")
    with pytest.raises(HubError, match="could not be listed to pick the file of tag 'Q8_0'.*--gguf-file"):
        vkgguf.gguf_file_of_tag("org/absent", "Q8_0")


def test_parse_repo_tag(tmp_path, monkeypatch):
    assert vkgguf.parse_repo_tag("org/Model-GGUF:Q4_K_M") == ("org/Model-GGUF", "Q4_K_M")
    for name in ("org/Model-GGUF", "model.gguf", "./org/x:Q4", "a/b/c:Q4", "org/x:", "C:/models/m.gguf"):
        assert vkgguf.parse_repo_tag(name) is None
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "x:Q4").mkdir()  # a local folder of that name is taken as it is
    assert vkgguf.parse_repo_tag("org/x:Q4") is None


# -- the command line -------------------------------------------------------------------------------------------
def generated(capsys, argv) -> str:
    assert main(argv) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_cli_model_by_tag_and_gguf_file(hub, tiny_gguf, capsys):
    prompt = ["--prompt", "the capital of france is", "--max-new-tokens", "5"]
    want = generated(capsys, ["generate", "--model", str(tiny_gguf)] + prompt)
    assert len(want.strip()) > 0
    assert generated(capsys, ["generate", "--model", "org/Tiny-GGUF:q8_0"] + prompt) == want
    assert hub.listed == [("org/Tiny-GGUF", None, None)] and hub.fetched("org/Tiny-GGUF") == ["tiny.Q8_0.gguf"]
    assert generated(capsys, ["generate", "--model", "org/Tiny-GGUF", "--gguf-file", "tiny.Q8_0.gguf"] + prompt) == want
    assert generated(capsys, ["generate", "--model", str(tiny_gguf), "--assistant-model", "org/Tiny-GGUF:Q8_0"]
                     + prompt) == want  # the same model drafting: the same text
    assert generated(capsys, ["generate", "--model", str(tiny_gguf), "--tokenizer", "org/Tiny-GGUF:Q8_0"]
                     + prompt) == want  # the tokenizer of a GGUF file by its tag


def test_training_records_the_model_as_given_not_the_cache_path(hub, tmp_path, capsys):
    """``train --model org/repo:TAG``: the run's files name the model as the user gave it (an adapter's PEFT
    base_model_name_or_path, the checkpoint's run record), never the HF cache path it was fetched to."""
    data = tmp_path / "text.txt"
    data.write_text("the capital of france is paris. " * 20)
    out = tmp_path / "run"
    assert main(["train", "--model", "org/Tiny-GGUF:Q8_0", "--tokenizer", "org/Tiny-GGUF:Q8_0", "--data", str(data),
                 "--lora-rank", "2", "--steps", "1", "--batch-size", "1", "--seq-len", "8", "--eval-fraction", "0",
                 "--no-progress", "--out", str(out)]) == 0, capsys.readouterr().err
    adapter = json.loads((out / "final" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "org/Tiny-GGUF:Q8_0"
    state = json.loads(next(out.glob("checkpoints/*/trainer_state.json")).read_text())
    assert state["run"]["model"] == state["run"]["tokenizer"] == "org/Tiny-GGUF:Q8_0"
    assert str(hub.cache) not in json.dumps(state) + json.dumps(adapter)


def test_cli_model_by_tag_errors(hub, capsys):
    assert main(["generate", "--model", "org/Model-GGUF:Q4_K", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("vkformers generate: error: org/Model-GGUF:Q4_K: several GGUF files")
    assert "Model.Q4_K_M.gguf, Model.Q4_K_S.gguf" in err and len(err.splitlines()) == 1
    assert main(["generate", "--model", "org/Model-GGUF:Q8_0", "--gguf-file", "Model.Q8_0.gguf", "--prompt", "hi"]) == 1
    assert "picks its GGUF file by the tag 'Q8_0' and --gguf-file names one too" in capsys.readouterr().err
    assert main(["bench", "--gguf-file", "Model.Q8_0.gguf"]) == 1
    assert "--gguf-file names a file of --model's folder or hub repo: give --model too" in capsys.readouterr().err
    assert hub.calls == []


def test_served_name_of_a_gguf_model():
    assert served_name("org/Model-GGUF:Q4_K_M") == "org/Model-GGUF:Q4_K_M"
    assert served_name("/models/Model-Q8_0-00001-of-00003.gguf") == "Model-Q8_0"
    assert served_name("org/Split-GGUF", "Q8_0/Model-Q8_0-00002-of-00003.gguf") == "Model-Q8_0"
    assert served_name("org/Model-GGUF", "Model.Q4_K_M.gguf") == "Model.Q4_K_M"
    assert served_name("./my-model/") == "./my-model" and served_name("/m/tiny.gguf") == "tiny"
