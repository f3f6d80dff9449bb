"""Task heads and base models against transformers (tests/fixtures/heads, written by tools/make_head_fixtures.py):
logits, loss and every gradient of sequence classification (single-label, multi-label, regression), token
classification (-100 labels), question answering and multiple choice, on a batch with a right-padded and a left-padded
row, and logits, loss and the head's gradients on a clean batch given without an attention mask; the base model's
last_hidden_state, pooler_output and hidden_states, read from the task checkpoint (prefixed names) and from a
base-model checkpoint (no prefix). float32; every value within the LM parity suite's tolerances (logits 1e-4
absolute, loss 1e-5 relative, each gradient within 1e-3 of its tensor's largest entry, ZERO_FLOOR below) and
elementwise within ATOL + RTOL * |value|."""
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import vkformers
from vkformers.models.heads import TaskHeadError

from test_decoder_parity import GRAD_RTOL, LOGITS_ATOL, LOSS_RTOL

FIXTURES = Path(__file__).parent / "fixtures" / "heads"
CASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "reference.safetensors").is_file())
AUTO = {"sequence": vkformers.AutoModelForSequenceClassification, "token": vkformers.AutoModelForTokenClassification,
        "qa": vkformers.AutoModelForQuestionAnswering, "choice": vkformers.AutoModelForMultipleChoice}
ATOL, RTOL = 2e-5, 1e-4
GRAD_ATOL = 2e-5
# The LM suite's gradient floor is 1e-3 * 1e-3 * G (G: the model's largest gradient) for gradients that are zero
# in exact arithmetic. A question-answering head makes two of them (its bias and the bias of the norm before it:
# the softmax over tokens ignores a shift shared by every token), whose float32 rounding reaches 2e-6 G in these
# hidden-8 models (G about 0.02): here the floor is 1e-3 * 1e-2 * G.
ZERO_FLOOR = 1e-2


def load_case(name):
    folder = FIXTURES / name
    return folder, json.loads((folder / "meta.json").read_text()), load_file(str(folder / "reference.safetensors"))


def close(actual, expected, what, atol=ATOL):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected.astype(np.float64), atol=atol, rtol=RTOL,
                               err_msg=what)


@pytest.mark.parametrize("name", CASES)
def test_head_matches_transformers(name):
    folder, meta, ref = load_case(name)
    model = AUTO[meta["task"]].from_pretrained(folder)
    variants = sorted({key.split(".")[0] for key in ref if key.endswith(".loss")} - {"bf16"})  # bf16: below
    assert "clean" in variants and "single" in variants
    if meta["task"] == "token":  # -100 labels take no part in the loss, padded positions and one real token
        assert (ref["single.labels"] == -100).sum() > (ref["attention_mask"] == 0).sum() > 0
    for variant in variants:
        # the clean batch: no padding, and no attention mask given
        ids, mask = (ref["clean.input_ids"], None) if variant == "clean" else (ref["input_ids"], ref["attention_mask"])
        if meta["task"] == "sequence":
            model.config["problem_type"] = {"single": None, "clean": None, "multi": "multi_label_classification",
                                            "regression": "regression"}[variant]
        labels = {key.split(".", 1)[1]: ref[key] for key in ref
                  if key.startswith(variant + ".") and key.split(".", 1)[1] in
                  ("labels", "start_positions", "end_positions")}
        model.train()
        out = model(input_ids=ids, attention_mask=mask, **labels)
        for field in ("start_logits", "end_logits") if meta["task"] == "qa" else ("logits",):
            logits, expected = getattr(out, field).numpy(), ref[f"{variant}.{field}"]
            close(logits, expected, f"{variant} {field}")
            error = np.abs(logits - expected).max()
            assert error <= LOGITS_ATOL, f"{variant} {field} differ by {error:.3g} (LM suite: {LOGITS_ATOL})"
        loss, expected = float(out.loss.numpy().reshape(-1)[0]), float(ref[f"{variant}.loss"][0])
        close(np.array([loss]), ref[f"{variant}.loss"], f"{variant} loss")
        assert abs(loss - expected) <= LOSS_RTOL * abs(expected), f"{variant} loss {loss} vs {expected}"
        for param in model.parameters():
            param.grad = None
        out.loss.backward()
        grads = {key.split(".grad.", 1)[1]: value for key, value in ref.items() if key.startswith(variant + ".grad.")}
        params = dict(model.named_parameters())
        if variant == "single":  # every parameter transformers trains has a gradient here, and no other
            trainable = {n for n, p in params.items() if p.requires_grad}  # frozen: RoFormer's sinusoids
            assert set(grads) <= trainable, sorted(set(grads) - trainable)
            for pname in sorted(trainable - set(grads)):  # a module the head does not run (BigBird's pooler)
                grad = params[pname].grad
                assert grad is None or not grad.numpy().any(), f"{pname}: a gradient where transformers has none"
        assert grads, f"{variant}: no reference gradients"
        # the floor for gradients that are zero but for rounding (a QA bias): the whole model's largest gradient
        largest = max(np.abs(value).max() for key, value in ref.items() if key.startswith("single.grad."))
        for pname, expected in grads.items():
            grad = params[pname].grad
            if grad is None and not expected.any():  # a module the head does not run (ESM's contact head)
                continue
            assert grad is not None, f"{variant}: no gradient for {pname}"
            close(grad.numpy(), expected, f"{variant} grad {pname}", atol=GRAD_ATOL)
            error, bound = np.abs(grad.numpy() - expected).max(), GRAD_RTOL * max(np.abs(expected).max(),
                                                                                  ZERO_FLOOR * largest)
            assert error <= bound, f"{variant} grad {pname}: {error:.3g} > {bound:.3g} (LM suite's bound)"


def base_outputs_match(model, ref):
    if "base.encoder_last_hidden_state" in ref:  # an encoder-decoder: its decoder reads the input shifted right
        out = model(input_ids=ref["input_ids"], attention_mask=ref["attention_mask"])
        close(out.encoder_last_hidden_state.numpy(), ref["base.encoder_last_hidden_state"], "encoder_last_hidden_state")
        close(out.last_hidden_state.numpy(), ref["base.last_hidden_state"], "last_hidden_state")
        return
    out = model(input_ids=ref["input_ids"], attention_mask=ref["attention_mask"], output_hidden_states=True)
    close(out.last_hidden_state.numpy(), ref["base.last_hidden_state"], "last_hidden_state")
    if "base.pooler_output" in ref:
        close(out.pooler_output.numpy(), ref["base.pooler_output"], "pooler_output")
    count = len([k for k in ref if k.startswith("base.hidden_states.")])
    assert len(out.hidden_states) == count
    for i, hidden in enumerate(out.hidden_states):
        close(hidden.numpy(), ref[f"base.hidden_states.{i}"], f"hidden_states[{i}]")


@pytest.mark.parametrize("name", ["bert-sequence", "llama-sequence", "roberta-sequence", "gemma-sequence",
                                  "bart-sequence", "mixtral-sequence", "deberta-v2-sequence", "deberta-sequence",
                                  "mpnet-sequence", "gte-sequence", "albert-sequence", "plbart-sequence",
                                  "xlm-sequence", "modernbert-sequence", "xlnet-sequence"])
def test_auto_model_reads_prefixed_and_bare_checkpoints(name, tmp_path):
    folder, meta, ref = load_case(name)
    base_outputs_match(vkformers.AutoModel.from_pretrained(folder), ref)
    # a base-model checkpoint (transformers' BertModel.save_pretrained): no prefix, no head
    model = vkformers.AutoModel.from_pretrained(folder)
    prefix = model.base_model_prefix + "."
    weights = load_file(str(folder / "model.safetensors"))
    save_file({k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    base_outputs_match(vkformers.AutoModel.from_pretrained(tmp_path), ref)


def test_fresh_head_from_a_base_checkpoint(tmp_path, capfd):
    folder, _, ref = load_case("bert-sequence")
    weights = load_file(str(folder / "model.safetensors"))
    save_file({k[len("bert."):]: v for k, v in weights.items() if k.startswith("bert.")}, str(tmp_path / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config.pop("id2label"), config.pop("label2id")
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = vkformers.AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=5)
    assert "freshly initialised: classifier.weight, classifier.bias" in capfd.readouterr().err
    assert model.config["num_labels"] == 5 and model.config["id2label"]["4"] == "LABEL_4"
    out = model(input_ids=ref["input_ids"], attention_mask=ref["attention_mask"])
    assert out.logits.shape == (3, 5) and np.isfinite(out.logits.numpy()).all()
    close(model.base.state_dict()["bert.pooler.dense.weight"], weights["bert.pooler.dense.weight"], "base weights kept")


def test_decoder_batch_without_pad_token_is_refused():
    folder, _, ref = load_case("llama-sequence")
    config = json.loads((folder / "config.json").read_text())
    config["pad_token_id"] = None
    model = vkformers.AutoModelForSequenceClassification.from_config(config)
    model.load_state_dict(load_file(str(folder / "model.safetensors")))
    with pytest.raises(TaskHeadError, match="pad token"):
        model(input_ids=ref["input_ids"])


@pytest.mark.parametrize("name", ["t5", "bart", "marian"])
def test_encoder_decoder_base_model(name):
    """AutoModel of an encoder-decoder (T5Model, BartModel, MarianModel) from the seq2seq parity fixture's
    checkpoint (a ForConditionalGeneration one, LM head left out): the decoder's and the encoder's last hidden
    states and every hidden state of both stacks (output_hidden_states=True) on a padded batch."""
    ref = load_file(str(FIXTURES / "seq2seq-base" / f"{name}.safetensors"))
    model = vkformers.AutoModel.from_pretrained(FIXTURES.parent / "seq2seq" / name)
    assert not any("lm_head" in n for n, _ in model.named_parameters())
    out = model(input_ids=ref["input_ids"], attention_mask=ref["attention_mask"],
                decoder_input_ids=ref["decoder_input_ids"], output_hidden_states=True)
    close(out.encoder_last_hidden_state.numpy(), ref["encoder_last_hidden_state"], "encoder_last_hidden_state")
    close(out.last_hidden_state.numpy(), ref["last_hidden_state"], "last_hidden_state")
    for stack in ("encoder", "decoder"):  # output_hidden_states: the embeddings, then each layer's output
        hidden = getattr(out, f"{stack}_hidden_states")
        assert len(hidden) == len([k for k in ref if k.startswith(f"{stack}_hidden_states.")])
        for i, state in enumerate(hidden):
            close(state.numpy(), ref[f"{stack}_hidden_states.{i}"], f"{stack}_hidden_states[{i}]")


def test_head_of_another_size(capfd):
    folder, _, ref = load_case("bert-sequence")  # a 3-label head
    with pytest.raises(TaskHeadError, match="ignore_mismatched_sizes=True"):
        vkformers.AutoModelForSequenceClassification.from_pretrained(folder, num_labels=5)
    model = vkformers.AutoModelForSequenceClassification.from_pretrained(folder, num_labels=5,
                                                                       ignore_mismatched_sizes=True)
    assert "freshly initialised: classifier.weight, classifier.bias" in capfd.readouterr().err
    assert model(input_ids=ref["input_ids"], attention_mask=ref["attention_mask"]).logits.shape == (3, 5)


@pytest.mark.parametrize("name,prefix,usual", [("llama-qa", "transformer", "model"),
                                               ("qwen2-qa", "transformer", "model"),
                                               ("t5-sequence", "transformer", ""),
                                               ("t5-token", "transformer", "")])
def test_head_under_another_prefix(name, prefix, usual, tmp_path, capfd):
    """transformers keeps LlamaForQuestionAnswering's base under transformer. (LlamaModel's task models say
    model.), T5ForSequenceClassification's T5Model and T5ForTokenClassification's T5EncoderModel under
    transformer.: the head model's names are those, and it also reads a checkpoint of the usual layout (a causal
    LM's model.*, a T5 model's bare names) with a new head."""
    folder, meta, ref = load_case(name)
    model = AUTO[meta["task"]].from_pretrained(folder)
    names = [n for n, _ in model.named_parameters()]
    head = {n for n in names if not n.startswith(prefix + ".")}
    assert model.base_model_prefix == prefix and head and all(n.split(".")[0] in ("qa_outputs", "classification_head", "classifier")
                                                              for n in head)
    weights = load_file(str(folder / "model.safetensors"))
    usual_names = {(usual + "." if usual else "") + k[len(prefix) + 1:]: v for k, v in weights.items()
                   if k.startswith(prefix + ".")}
    save_file(usual_names, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    fresh = AUTO[meta["task"]].from_pretrained(tmp_path)
    assert "freshly initialised" in capfd.readouterr().err
    state = fresh.state_dict()
    for key, value in weights.items():
        if key.startswith(prefix + "."):
            close(state[key], value, f"{key} read from the usual layout")


# bfloat16 keeps 8 significant bits (a step of 2**-8 relative): vkformers and torch round at different points
# (vkformers accumulates matmuls in float32), so logits, loss and the head's gradients agree to about one step
# at |x| <= 1, where the float32 run differs from either by as much
BF16_ATOL, BF16_RTOL = 4e-3, 2 ** -7


def test_head_in_bfloat16():
    folder, _, ref = load_case("bert-sequence")
    model = vkformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype="bfloat16").train()
    assert all(p.dtype == vkformers.bfloat16 for p in model.parameters())
    out = model(input_ids=ref["input_ids"], attention_mask=ref["attention_mask"], labels=ref["single.labels"])
    np.testing.assert_allclose(np.asarray(out.logits.numpy(), np.float32), ref["bf16.logits"], atol=BF16_ATOL,
                               rtol=BF16_RTOL, err_msg="bf16 logits")
    np.testing.assert_allclose(np.asarray(out.loss.numpy(), np.float32).reshape(1), ref["bf16.loss"],
                               atol=BF16_ATOL, rtol=BF16_RTOL, err_msg="bf16 loss")
    out.loss.backward()
    params = dict(model.named_parameters())
    grads = {key[len("bf16.grad."):]: value for key, value in ref.items() if key.startswith("bf16.grad.")}
    assert sorted(grads) == ["classifier.bias", "classifier.weight"]
    for name, expected in grads.items():
        np.testing.assert_allclose(np.asarray(params[name].grad.numpy(), np.float32), expected, atol=BF16_ATOL,
                                   rtol=BF16_RTOL, err_msg=f"bf16 grad {name}")


def test_longformer_global_attention_from_the_caller_and_the_separators():
    """Longformer's heads take the caller's global_attention_mask as transformers does (an explicit mask equal to the
    default gives the same logits; another one changes them), and the question-answering head refuses rows without
    exactly three separators, naming global_attention_mask."""
    folder, _, ref = load_case("longformer-sequence")
    model = vkformers.AutoModelForSequenceClassification.from_pretrained(folder)
    ids, mask = ref["input_ids"], ref["attention_mask"]
    first = np.zeros_like(ids)
    first[:, 0] = 1
    default = model(ids, attention_mask=mask).logits.numpy()
    close(default, ref["single.logits"], "logits")
    close(model(ids, attention_mask=mask, global_attention_mask=first).logits.numpy(), default,
          "explicit first-token global mask")
    assert np.abs(model(ids, attention_mask=mask, global_attention_mask=np.zeros_like(ids)).logits.numpy()
                  - default).max() > 1e-4  # no global token: another result
    local = vkformers.AutoModel.from_pretrained(folder)(ids, attention_mask=mask).last_hidden_state.numpy()
    assert np.abs(local[0, 0] - model.base.forward(ids, mask).last_hidden_state.numpy()[0, 0]).max() > 1e-3
    qa_folder, _, _ = load_case("longformer-qa")
    qa = vkformers.AutoModelForQuestionAnswering.from_pretrained(qa_folder)
    with pytest.raises(TaskHeadError, match="global_attention_mask"):
        qa(ref["input_ids"], attention_mask=ref["attention_mask"])
