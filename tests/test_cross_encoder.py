"""vkformers.CrossEncoder against sentence-transformers' CrossEncoder on two tiny random cross-encoders it saved
(tests/fixtures/cross_encoder, written by tools/make_cross_encoder_reference.py): a BERT reranker (one label,
Sigmoid, max_length 24: four of the seven pairs truncated) and an XLM-R NLI model (three labels, Identity,
max_length 32: batches padded to a multiple of 16). Seven pairs of 11 to 32 tokens in batches of 4 (padded);
sentence-transformers' scores in float32 within ATOL (probabilities and softmax rows) and LOGITS_ATOL (the logits of
two float32 encoder layers on lavapipe, O(1)), as are batches of other sizes against one batch. The layouts
sentence-transformers reads (its save_pretrained, config.json's activation of versions 4 and 5, the key before 4, a
plain transformers reranker) give the same scores through their activations."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import vkformers
from vkformers.models.cross_encoder import CrossEncoderError
from vkformers.models.sentence import SentenceTransformerError, is_cross_encoder_checkpoint, is_embedding_checkpoint

FIXTURES = Path(__file__).parent / "fixtures" / "cross_encoder"
REFERENCE = json.loads((FIXTURES / "reference.json").read_text())
PAIRS = REFERENCE["pairs"]
BATCH = REFERENCE["meta"]["batch_size"]
ATOL = 1e-6         # sigmoid and softmax outputs, in [0, 1]
LOGITS_ATOL = 1e-5  # raw logits of magnitude up to 2


@pytest.fixture(scope="module")
def reranker():
    return vkformers.CrossEncoder(FIXTURES / "bert-reranker")


@pytest.fixture(scope="module")
def nli():
    return vkformers.CrossEncoder(FIXTURES / "xlm-roberta-nli")


def assert_scores(actual, expected, atol=ATOL):
    expected = np.asarray(expected, np.float32)
    assert isinstance(actual, np.ndarray) and actual.dtype == np.float32 and actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, atol=atol, rtol=0)


def test_the_reranker_matches_sentence_transformers(reranker):
    ref = REFERENCE["bert-reranker"]
    assert reranker.num_labels == 1 and reranker.max_length == ref["max_length"] == 24
    assert reranker.activation_fn == "torch.nn.modules.activation.Sigmoid"
    assert reranker.token_counts(PAIRS) == ref["token_counts"]
    assert_scores(reranker.predict(PAIRS, batch_size=BATCH), ref["predict"])
    assert_scores(reranker.predict(PAIRS, batch_size=BATCH, activation_fn="torch.nn.modules.linear.Identity"),
                  ref["logits"], LOGITS_ATOL)
    single = reranker.predict(PAIRS[5])
    assert np.ndim(single) == 0 and abs(float(single) - ref["single"]) <= ATOL


def test_the_nli_model_matches_sentence_transformers(nli):
    ref = REFERENCE["xlm-roberta-nli"]
    assert nli.num_labels == 3 and nli.max_length == ref["max_length"] == 32
    assert nli.activation_fn == "torch.nn.modules.linear.Identity"
    assert nli.token_counts(PAIRS) == ref["token_counts"]
    assert_scores(nli.predict(PAIRS, batch_size=BATCH), ref["predict"], LOGITS_ATOL)
    softmax = nli.predict(PAIRS, batch_size=BATCH, apply_softmax=True)
    assert_scores(softmax, ref["softmax"])
    np.testing.assert_allclose(softmax.sum(-1), 1, atol=1e-6)
    assert_scores(nli.predict(PAIRS, batch_size=BATCH, activation_fn=_torch_like("Sigmoid")), ref["sigmoid"])
    assert_scores(nli.predict(tuple(PAIRS[5])), ref["single"], LOGITS_ATOL)


def _torch_like(name):
    """An object of torch.nn's class ``name`` as sentence-transformers users pass one (torch is not needed)."""
    module = "torch.nn.modules." + ("linear" if name == "Identity" else "activation")
    return type(name, (), {"__module__": module, "__call__": lambda self, x: x})()


@pytest.mark.parametrize("name", ["bert-reranker", "xlm-roberta-nli"])
def test_batch_sizes_give_the_scores_of_one_batch(reranker, nli, name):
    """One batch of all seven pairs, batches of 2 (four, padded differently) and of 1 (no padding): the same
    scores, and sentence-transformers'."""
    model = reranker if name == "bert-reranker" else nli
    whole = model.predict(PAIRS, batch_size=len(PAIRS))
    atol = ATOL if name == "bert-reranker" else LOGITS_ATOL
    assert_scores(whole, REFERENCE[name]["predict"], atol)
    for batch_size in (2, 1):
        assert_scores(model.predict(PAIRS, batch_size=batch_size), whole, atol)


def test_batches_are_padded_to_their_longest_pair(reranker, nli):
    """The BERT reranker's max_length 24 is no multiple of 16: its batch is as long as its longest pair; the NLI
    model's 32 is, so its batch is rounded up to 32 (the shapes the recorded plans replay)."""
    short = [PAIRS[5], PAIRS[3]]  # 11 and 13 tokens (BERT), 12 and 15 (XLM-R)
    features = reranker.tokenize(short)
    assert features["input_ids"].shape == (2, 13) and features["attention_mask"].sum(1).tolist() == [11, 13]
    assert features["token_type_ids"][0].tolist() == [0] * 7 + [1] * 4 + [0] * 2  # [CLS] q [SEP] | d [SEP] | pad
    features = nli.tokenize(short)
    assert features["input_ids"].shape == (2, 16) and "token_type_ids" not in features


def test_rank_matches_sentence_transformers(reranker):
    ref = REFERENCE["bert-reranker"]
    ranked = reranker.rank(REFERENCE["query"], REFERENCE["documents"], batch_size=BATCH)
    assert [r["corpus_id"] for r in ranked] == [r["corpus_id"] for r in ref["rank"]]
    assert set(ranked[0]) == {"corpus_id", "score"} and all(isinstance(r["score"], float) for r in ranked)
    np.testing.assert_allclose([r["score"] for r in ranked], [r["score"] for r in ref["rank"]], atol=ATOL, rtol=0)
    top = reranker.rank(REFERENCE["query"], REFERENCE["documents"], top_k=2, return_documents=True)
    expected = ref["rank_top_2_documents"]
    assert [(r["corpus_id"], r["text"]) for r in top] == [(r["corpus_id"], r["text"]) for r in expected]
    assert reranker.rank(REFERENCE["query"], []) == []


def test_outputs_and_activations(reranker):
    logits = np.asarray(REFERENCE["bert-reranker"]["logits"], np.float32)
    tensor = reranker.predict(PAIRS[:3], convert_to_tensor=True)
    assert isinstance(tensor, vkformers.Tensor) and tensor.shape == (3,)
    assert_scores(tensor.numpy(), REFERENCE["bert-reranker"]["predict"][:3])
    rows = reranker.predict(PAIRS[:3], convert_to_numpy=False)
    assert isinstance(rows, list) and len(rows) == 3
    one = reranker.predict(PAIRS[0], convert_to_numpy=False)
    assert isinstance(one, np.float32) and abs(float(one) - float(rows[0])) <= ATOL
    assert reranker.predict([]).shape == (0,)
    assert_scores(reranker.predict(PAIRS, activation_fn=lambda x: 2 * x), 2 * logits, 2 * LOGITS_ATOL)
    assert_scores(reranker.predict(PAIRS, activation_fn="torch.nn.modules.activation.Tanh"), np.tanh(logits),
                  LOGITS_ATOL)
    assert_scores(vkformers.CrossEncoder(FIXTURES / "bert-reranker", activation_fn=_torch_like("Identity")).predict(
        PAIRS), logits, LOGITS_ATOL)


def hub_layout(tmp_path, name: str, **config_keys) -> Path:
    """The fixture as a transformers checkpoint without sentence-transformers' own files, ``config_keys`` added to
    its config.json (what sentence-transformers' versions before 6 saved)."""
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name, folder, ignore=shutil.ignore_patterns(
        "modules.json", "config_sentence_transformers.json", "sentence_bert_config.json"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **config_keys}))
    return folder


def test_the_layouts_sentence_transformers_reads(tmp_path):
    logits = np.asarray(REFERENCE["bert-reranker"]["logits"], np.float32)
    sigmoid = np.asarray(REFERENCE["bert-reranker"]["predict"], np.float32)
    for case, (keys, expected, atol) in enumerate([
            ({}, sigmoid, ATOL),  # a plain reranker: Sigmoid for its one label
            ({"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity", "version": "4.1.0"}},
             logits, LOGITS_ATOL),
            ({"sbert_ce_default_activation_function": "torch.nn.modules.activation.Tanh"}, np.tanh(logits),
             LOGITS_ATOL)]):
        folder = hub_layout(tmp_path / str(case), "bert-reranker", **keys)
        assert is_cross_encoder_checkpoint(folder) and not is_embedding_checkpoint(folder)
        assert_scores(vkformers.CrossEncoder(folder).predict(PAIRS, batch_size=BATCH), expected, atol)
    folder = hub_layout(tmp_path, "xlm-roberta-nli")  # three labels and no activation named: a classifier
    assert not is_cross_encoder_checkpoint(folder)
    assert_scores(vkformers.CrossEncoder(folder).predict(PAIRS[:2]), REFERENCE["xlm-roberta-nli"]["predict"][:2],
                  LOGITS_ATOL)
    assert is_cross_encoder_checkpoint(FIXTURES / "xlm-roberta-nli")
    assert not is_embedding_checkpoint(FIXTURES / "xlm-roberta-nli")
    folder = hub_layout(tmp_path / "custom", "bert-reranker",
                        sentence_transformers={"activation_fn": "my_package.Scale"})
    with pytest.warns(UserWarning, match="my_package.Scale is not torch's; the default is used"):
        assert vkformers.CrossEncoder(folder).activation_fn == "torch.nn.modules.activation.Sigmoid"


def test_max_length_and_num_labels(tmp_path):
    short = vkformers.CrossEncoder(FIXTURES / "bert-reranker", max_length=12)
    assert short.token_counts(PAIRS) == [12, 12, 12, 12, 12, 11, 12]
    assert short.tokenize(PAIRS)["input_ids"].shape == (7, 12)
    with pytest.raises(CrossEncoderError, match="max_length=65: pass a number of tokens up to the model's 64"):
        vkformers.CrossEncoder(FIXTURES / "bert-reranker", max_length=65)
    assert vkformers.CrossEncoder(FIXTURES / "bert-reranker", num_labels=1).num_labels == 1
    with pytest.raises(CrossEncoderError, match="num_labels=2: the checkpoint's classifier scores 1 label"):
        vkformers.CrossEncoder(FIXTURES / "bert-reranker", num_labels=2)


def test_refusals(reranker, nli, tmp_path):
    with pytest.raises(CrossEncoderError, match="rank\\(\\) scores with one label; this model has 3"):
        nli.rank("a query", ["a document"])
    for bad in ("a text", [["a", "b", "c"]], [("a", 1)], [["a", "b"], "c"]):
        with pytest.raises(CrossEncoderError, match="a pair of texts"):
            reranker.predict(bad)
    with pytest.raises(CrossEncoderError, match="batch_size=0"):
        reranker.predict(PAIRS, batch_size=0)
    with pytest.raises(SentenceTransformerError, match="rank\\(\\) takes a query text"):
        reranker.rank("q", "not a list")
    with pytest.raises(CrossEncoderError, match="activation_fn torch.nn.modules.activation.GELU"):
        reranker.predict(PAIRS, activation_fn="torch.nn.modules.activation.GELU")
    with pytest.raises(CrossEncoderError, match="trust_remote_code"):
        vkformers.CrossEncoder(FIXTURES / "bert-reranker", trust_remote_code=True)
    folder = tmp_path / "prompted"
    shutil.copytree(FIXTURES / "bert-reranker", folder)
    settings = json.loads((folder / "config_sentence_transformers.json").read_text())
    (folder / "config_sentence_transformers.json").write_text(json.dumps(
        {**settings, "prompts": {"query": "query: "}, "default_prompt_name": "query"}))
    with pytest.raises(CrossEncoderError, match="default_prompt_name 'query'"):
        vkformers.CrossEncoder(folder)
    (folder / "config_sentence_transformers.json").write_text(json.dumps(settings))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    with pytest.raises(CrossEncoderError, match="modules Transformer, Pooling; a cross-encoder has one Transformer"):
        vkformers.CrossEncoder(folder)
