"""Every input a model's forward or generate cannot run gets an InputError naming the argument and the fix.

The checks live once in core (Module.__call__, models/inputs.py); decoders, encoders and encoder-decoders declare
their vocabulary and position tables. Tiny fixtures: vocab_size 48; GPT-2 has 24 positions (n_positions), BERT and
RoBERTa 40 (RoBERTa's start past its padding id: 38 tokens), BART 24.
"""
import numpy as np
import pytest

from vkformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM
from vkformers.engine.tensor import Tensor
from vkformers.errors import InputError, VkformersError

FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures"
IDS = np.array([[1, 5, 9, 2]])
MODELS = {}


def model(kind, name):
    if name not in MODELS:
        auto = {"causal": AutoModelForCausalLM, "masked": AutoModelForMaskedLM, "seq2seq": AutoModelForSeq2SeqLM}
        MODELS[name] = auto[kind].from_pretrained(FIXTURES / name, requires_grad=False)
    return MODELS[name]


CASES = [("causal", "llama"), ("causal", "gpt2"), ("masked", "encoders/bert"), ("seq2seq", "seq2seq/t5")]


def call(kind, name, **inputs):
    if kind == "seq2seq":
        inputs.setdefault("decoder_input_ids", np.array([[0, 3]]))
    return model(kind, name)(**inputs)


@pytest.mark.parametrize("kind, name", CASES)
@pytest.mark.parametrize("ids, message", [
    (np.array([[1, -1, 3]]), r"input_ids holds id -1, outside the model's 48 ids \(vocab_size: 0 to 47\)"),
    (np.array([[1, 48, 3]]), r"input_ids holds id 48, outside the model's 48 ids"),
    (np.array([[1, 10 ** 6, 3]]), r"input_ids holds id 1000000"),
    (np.array([[1.5, 2.0]]), r"input_ids holds float64 values; token ids must be integers"),
    (np.zeros((1, 0), np.int64), r"input_ids has shape \(1, 0\): every row needs at least one token"),
    (np.ones((1, 2, 3), np.int64), r"input_ids has shape \(1, 2, 3\); it must be \[batch, length\]"),
])
def test_bad_token_ids(kind, name, ids, message):
    with pytest.raises(InputError, match=message):
        call(kind, name, input_ids=ids)


@pytest.mark.parametrize("kind, name", CASES)
@pytest.mark.parametrize("mask, message", [
    (np.ones((1, 3)), r"attention_mask has shape \(1, 3\), input_ids \(1, 4\); the mask needs one entry per token"),
    (np.ones((2, 4)), r"attention_mask has shape \(2, 4\)"),
    (np.array([[1, 1, 2, 1]]), r"attention_mask holds values other than 0 and 1"),
])
def test_bad_attention_mask(kind, name, mask, message):
    with pytest.raises(InputError, match=message):
        call(kind, name, input_ids=IDS, attention_mask=mask)


@pytest.mark.parametrize("kind, name", CASES)
def test_labels_outside_the_vocabulary_but_not_the_ignore_index(kind, name):
    labels = np.array([[1, 2, 3, 48]]) if kind != "seq2seq" else np.array([[3, 48]])
    with pytest.raises(InputError, match=r"labels hold 48, outside the model's 48 classes .*-100"):
        call(kind, name, input_ids=IDS, labels=labels)
    labels[0, -1] = -100  # ignored, as in transformers
    loss = call(kind, name, input_ids=IDS, labels=labels).loss.item()
    assert np.isfinite(loss)


def test_label_shape_must_match_the_tokens():
    with pytest.raises(InputError, match=r"labels has shape \(1, 3\), input_ids \(1, 4\); they must match"):
        call("causal", "llama", input_ids=IDS, labels=IDS[:, :3])
    with pytest.raises(InputError, match=r"labels has shape \(1, 3\), decoder_input_ids \(1, 2\)"):
        call("seq2seq", "seq2seq/t5", input_ids=IDS, labels=IDS[:, :3])


def test_tensor_inputs_are_checked_too():
    with pytest.raises(InputError, match=r"input_ids holds id 48"):
        call("causal", "llama", input_ids=Tensor(np.array([[1, 48]])))
    with pytest.raises(InputError, match=r"input_ids holds float32 values"):
        call("causal", "llama", input_ids=Tensor(np.array([[1.0, 2.0]])))


def test_learned_positions_refuse_a_longer_sequence():
    gpt2 = model("causal", "gpt2")
    assert gpt2(np.ones((1, 24), np.int64)).logits.shape == (1, 24, 48)  # the whole table: fine
    with pytest.raises(InputError, match=r"input_ids: 25 tokens run past the model's 24 positions \(n_positions\); "
                                         r"truncate the input to at most 24 tokens"):
        gpt2(np.ones((1, 25), np.int64))
    with pytest.raises(InputError, match=r"position_ids hold 24, past the model's 24 positions"):
        gpt2(IDS[:, :2], position_ids=np.array([[0, 24]]))
    with pytest.raises(InputError, match=r"position_ids hold -1; positions count from 0"):
        gpt2(IDS[:, :2], position_ids=np.array([[-1, 0]]))
    # a rotary model has no table to run past: transformers runs it too
    assert model("causal", "llama")(np.ones((1, 70), np.int64)).logits.shape[1] == 70


def test_generate_refuses_up_front_to_run_past_the_position_table():
    gpt2 = model("causal", "gpt2")
    prompt = np.ones((1, 20), np.int64)
    with pytest.raises(InputError, match=r"a prompt of 20 tokens and max_new_tokens=10 need 29 positions, past the "
                                         r"model's 24 \(n_positions\); pass max_new_tokens <= 5"):
        gpt2.generate(prompt, max_new_tokens=10)
    assert gpt2.generate(prompt, max_new_tokens=5).shape == (1, 25)  # the last token is never fed back
    with pytest.raises(InputError, match=r"a prompt of 24 tokens and max_new_tokens=2 need 25 positions.*<= 1"):
        gpt2.generate(np.ones((1, 24), np.int64), max_new_tokens=2)
    with pytest.raises(InputError, match=r"input_ids: 30 tokens run past the model's 24 positions"):
        gpt2.generate(np.ones((1, 30), np.int64), max_new_tokens=0)


def test_encoder_token_types_and_fairseq_positions():
    bert = model("masked", "encoders/bert")
    with pytest.raises(InputError, match=r"token_type_ids holds id 2, outside the model's 2 ids \(type_vocab_size"):
        bert(IDS, token_type_ids=np.array([[0, 1, 2, 0]]))
    with pytest.raises(InputError, match=r"token_type_ids has shape \(1, 3\), input_ids \(1, 4\)"):
        bert(IDS, token_type_ids=np.zeros((1, 3), np.int64))
    with pytest.raises(InputError, match=r"41 tokens run past the model's 40 positions \(max_position_embeddings\)"):
        bert(np.full((1, 41), 7))
    roberta = model("masked", "encoders/roberta")  # positions start at pad + 1 = 2: 38 tokens fill the 40 rows
    assert roberta(np.full((1, 38), 7)).logits.shape == (1, 38, 48)
    with pytest.raises(InputError, match=r"39 tokens run past the model's 38 positions"):
        roberta(np.full((1, 39), 7))


def test_seq2seq_decoder_inputs_and_positions():
    bart = model("seq2seq", "seq2seq/bart")
    with pytest.raises(InputError, match=r"decoder_input_ids holds id 48"):
        bart(IDS, decoder_input_ids=np.array([[2, 48]]))
    with pytest.raises(InputError, match=r"input_ids: 25 tokens run past the model's 24 positions"):
        bart(np.full((1, 25), 7), decoder_input_ids=IDS)
    with pytest.raises(InputError, match=r"decoder_input_ids: 25 tokens run past the model's 24 positions"):
        bart(IDS, decoder_input_ids=np.full((1, 25), 7))
    with pytest.raises(InputError, match=r"labels: 25 tokens run past"):  # the decoder reads the labels shifted
        bart(IDS, labels=np.full((1, 25), 7))
    with pytest.raises(InputError, match=r"decoder_attention_mask has shape \(1, 1\), input_ids \(1, 2\)"):
        bart(IDS, decoder_input_ids=np.array([[2, 5]]), decoder_attention_mask=np.ones((1, 1)))
    with pytest.raises(InputError, match=r"the decoder start token and max_new_tokens=30 need 30 positions, past "
                                         r"the model's 24 \(max_position_embeddings\); pass max_new_tokens <= 24"):
        bart.generate(IDS, max_new_tokens=30)
    with pytest.raises(InputError, match=r"input_ids holds id 48"):
        bart.generate(np.array([[1, 48]]), max_new_tokens=2)


@pytest.mark.parametrize("kind, name", [("causal", "llama"), ("seq2seq", "seq2seq/t5")])
@pytest.mark.parametrize("settings, message", [
    (dict(temperature=float("nan")), r"temperature must be a finite number >= 0, got nan"),
    (dict(temperature=-1.0), r"temperature must be a finite number >= 0, got -1.0"),
    (dict(temperature=float("inf"), do_sample=True), r"temperature must be a finite number >= 0, got inf"),
    (dict(temperature=0.0, do_sample=True), r"temperature must be > 0 when sampling"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=1.5, do_sample=True), r"top_p must be in \(0, 1\], got 1.5"),
    (dict(top_k=-1), r"top_k must be a finite whole number >= 0, got -1"),
    (dict(max_new_tokens=-1), r"max_new_tokens must be a finite whole number >= 0, got -1"),
    (dict(max_new_tokens=2.5), r"max_new_tokens must be a whole number, got 2.5"),
    (dict(max_new_tokens="8"), r"max_new_tokens must be a number, got '8'"),
])
def test_invalid_generation_settings(kind, name, settings, message):
    with pytest.raises(InputError, match=message):
        model(kind, name).generate(IDS, **settings)


def test_repetition_penalty_and_greedy_temperature_zero():
    llama = model("causal", "llama")
    with pytest.raises(InputError, match=r"repetition_penalty must be a finite number > 0, got 0"):
        llama.generate(IDS, repetition_penalty=0)
    # temperature 0 with greedy decoding is what do_sample=False means: allowed, the same tokens
    np.testing.assert_array_equal(llama.generate(IDS, max_new_tokens=3, temperature=0.0),
                                  llama.generate(IDS, max_new_tokens=3))


def test_input_errors_are_vkformers_errors():
    from vkformers.models.cache import CacheFullError
    assert issubclass(InputError, VkformersError) and issubclass(InputError, ValueError)
    assert issubclass(CacheFullError, VkformersError)  # more tokens than a cache given to forward holds
