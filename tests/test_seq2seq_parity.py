"""The shared encoder-decoder (vkformers-t5) against transformers 5.24: every fixture in tests/fixtures/seq2seq/.

Each fixture (tools/make_seq2seq_fixtures.py) is a tiny random *ForConditionalGeneration checkpoint plus
transformers' own outputs for input_ids [2, 8] (row 1 right-padded by 2) and labels [2, 6] with some -100.
A new fixture folder is tested automatically. Tolerances (float32):
- logits 1e-4 absolute; loss 1e-5 relative;
- gradients: per tensor, max |ours - theirs| <= 1e-3 * max(max |theirs|, 1e-3 * G), G the largest gradient
  magnitude of the model (the floor is for tensors whose exact gradient is zero, e.g. key biases: softmax
  ignores a shift shared by all of a query's scores, so the reference holds rounding noise there);
- one AdamW step (lr 1e-2, weight decay 0.01) from the reference gradients: 1e-5 absolute;
- greedy decoding with the KV cache: the tokens equal transformers', each step's logits within 1e-4 of
  transformers' (its own cached generate), and for the fixtures in CACHE_CHECKED, within 1e-4 of our own
  forward without a cache over the generated tokens.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from safetensors.numpy import load_file, save_file

import vkformers as vkf
from vkformers.engine.lazy import realize
from vkformers.engine.tensor import parameter
from vkformers.errors import InputError
from vkformers.models.encoder_decoder import UnsupportedEncoderDecoder
from vkformers.models.loading import AutoModelForSeq2SeqLM
from vkformers.optim import AdamW

from fixture_cases import CLEAN_GENERATION, CachedCase, fixture_folders, read_reference

FIXTURES = Path(os.environ.get("VKFORMERS_SEQ2SEQ_FIXTURES", Path(__file__).parent / "fixtures" / "seq2seq"))
LOGITS_ATOL = 1e-4
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-3
ADAMW_ATOL = 1e-5
# The cache paths differ by attention kind, not by variant: t5 runs the composed attention with the relative
# bias over its cache, bart the fused decode kernel (m2m_100: positions counted over non-pad tokens); the
# EncoderDecoderModels each decoder's own (BERT's post-LN layers, GPT-2's cross-attention in the decoder kit).
CACHE_CHECKED = ("t5", "bart", "m2m_100", "bert2bert", "bert2gpt2")


def fixture_names() -> list[str]:
    return fixture_folders(FIXTURES)


class Case(CachedCase):
    """One fixture, run once per test session: forward with labels and backward, realized in one submit."""


    def __init__(self, name: str):
        self.folder = FIXTURES / name
        self.meta = json.loads((self.folder / "meta.json").read_text())
        self.ref = read_reference(self.folder / "reference.safetensors")
        self.model = AutoModelForSeq2SeqLM.from_pretrained(self.folder, dtype="float32")
        extra = {"global_attention_mask": self.ref["global_attention_mask"]} \
            if "global_attention_mask" in self.ref else {}  # LED: tokens with global attention
        out = self.model(self.ref["input_ids"].astype(np.int64), attention_mask=self.ref["attention_mask"],
                         labels=self.ref["labels"].astype(np.int64), **extra)
        out.loss.backward()
        self.params = dict(self.model.named_parameters())
        realize([out.logits.lazy, out.loss.lazy] + [p.grad.lazy for p in self.params.values() if p.grad is not None])
        self.logits, self.loss = out.logits.numpy(), out.loss.item()
        self.grads = {n: None if p.grad is None else p.grad.numpy() for n, p in self.params.items()}
        for p in self.params.values():
            p.grad = None


@pytest.mark.parametrize("name", fixture_names())
def test_logits(name):
    check_logits(name, Case.get(name))


def check_logits(name: str, case: Case) -> None:
    error = np.abs(case.logits - case.ref["logits"]).max()
    assert error <= LOGITS_ATOL, f"{name}: logits differ by {error:.3g}"


@pytest.mark.parametrize("name", fixture_names())
def test_loss(name):
    case = Case.get(name)
    expected = float(case.ref["loss"])
    error = abs(case.loss - expected) / abs(expected)
    assert error <= LOSS_RTOL, f"{name}: loss {case.loss} vs {expected} (relative error {error:.3g})"


def trainable_reference_names(case: Case) -> list[str]:
    """transformers' trainable parameters; frozen ones (fixed sinusoidal tables) are computed, not parameters.
    A trainable parameter transformers gave no gradient (a Switch expert no token chose) gets none here either
    (test_gradient_presence), and the AdamW step leaves it alone in both."""
    frozen = set(case.meta["params_frozen"])
    return [n for n in case.meta["parameters"] if n not in frozen]


@pytest.mark.parametrize("name", fixture_names())
def test_gradients(name):
    check_gradients(name, Case.get(name))


def check_gradients(name: str, case: Case) -> None:
    names = trainable_reference_names(case)
    assert sorted(names) == sorted(case.params), (
        f"{name}: parameters differ from transformers': only ours {sorted(set(case.params) - set(names))}, "
        f"only theirs {sorted(set(names) - set(case.params))}")
    largest = max(np.abs(case.ref[f"grad.{n}"]).max() for n in names)
    failures = []
    for n in names:
        expected = case.ref[f"grad.{n}"]
        got = case.grads[n] if case.grads[n] is not None else np.zeros_like(expected)
        error = np.abs(got - expected).max()
        bound = GRAD_RTOL * max(np.abs(expected).max(), 1e-3 * largest)
        if not error <= bound:
            failures.append(f"{n}: {error:.3g} > {bound:.3g}")
    assert not failures, f"{name}: gradients differ: " + "; ".join(failures)


@pytest.mark.parametrize("name", fixture_names())
def test_gradient_presence(name):
    """A parameter has a gradient (zeros included) exactly where torch gives it one: torch's AdamW decays a
    parameter whose gradient is zero and skips one without (meta.json params_without_grad)."""
    check_gradient_presence(name, Case.get(name))


def check_gradient_presence(name: str, case: Case) -> None:
    without_grad = set(case.meta["params_without_grad"])
    differ = [f"{n}: " + ("no gradient, where torch has one" if case.grads[n] is None
                          else "a gradient, where torch has none")
              for n in sorted(case.grads) if (case.grads[n] is None) != (n in without_grad)]
    assert not differ, f"{name}: " + "; ".join(differ)


@pytest.mark.parametrize("name", fixture_names())
def test_one_adamw_step(name):
    case = Case.get(name)
    # copies of the loaded parameters take the step, so the cached model keeps its weights for the decoding test
    params = {n: parameter(p.numpy(), dtype=p.dtype, name=n) for n, p in case.params.items()}
    unused = set(case.meta["params_without_grad"])  # transformers' AdamW skips a parameter without gradient
    for n, p in params.items():
        p.grad = None if n in unused else vkf.tensor(case.ref[f"grad.{n}"])
    AdamW(list(params.values()), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01).step()
    realize([p.lazy for p in params.values()])
    for n, p in params.items():
        np.testing.assert_allclose(p.numpy(), case.ref[f"adamw.{n}"], atol=ADAMW_ATOL, rtol=0, err_msg=n)


def _generate(name):
    case = Case.get(name)  # the loaded model, untouched by the AdamW test (generate runs without gradients)
    model, ref = case.model, case.ref
    expected = ref["greedy_tokens"].astype(np.int64)
    prompt = ref["input_ids"][:1].astype(np.int64)
    tokens, logits = model.generate(prompt, max_new_tokens=expected.shape[1] - 1, do_sample=False, eos_token_id=[],
                                    output_logits=True, **CLEAN_GENERATION)
    return model, ref, prompt, expected, tokens, logits[:, 0]


@pytest.mark.parametrize("name", fixture_names())
def test_greedy_tokens_with_cache(name):
    model, ref, prompt, expected, tokens, logits = _generate(name)
    assert tokens.tolist() == expected.tolist(), f"{name}: {tokens.tolist()} vs transformers {expected.tolist()}"
    error = np.abs(logits - ref["greedy_logits"]).max()
    assert error <= LOGITS_ATOL, f"{name}: cached step logits differ from transformers' by {error:.3g}"
    if name in CACHE_CHECKED:
        uncached = model(prompt, decoder_input_ids=tokens[:, :-1]).logits.numpy()[0]
        error = np.abs(uncached - logits).max()
        assert error <= LOGITS_ATOL, f"{name}: cached decoding differs from the uncached forward by {error:.3g}"


def test_generate_stops_at_eos_and_pads():
    """A row that produced eos is finished: later tokens are pad, and generation stops once all rows are done."""
    case = Case.get("bart")
    model, ref = case.model, case.ref
    greedy = ref["greedy_tokens"].astype(np.int64)[0]
    eos = int(greedy[3])  # a generated token plays eos: decoding ends at its first occurrence
    first = 1 + list(greedy[1:]).index(eos)
    prompt = np.repeat(ref["input_ids"][:1].astype(np.int64), 2, axis=0)
    tokens = model.generate(prompt, max_new_tokens=8, eos_token_id=eos)
    assert tokens.tolist() == [greedy[:first + 1].tolist()] * 2


def test_transformers_length_arguments_count_the_decoder_tokens():
    """max_length counts the decoder's tokens, its start token included (transformers' encoder-decoder
    generate); num_return_sequences gives each prompt's rows one after another; an unknown argument is named."""
    case = Case.get("bart")
    model, prompt = case.model, case.ref["input_ids"][:1].astype(np.int64)
    four = model.generate(prompt, max_new_tokens=4, eos_token_id=[])
    np.testing.assert_array_equal(model.generate(prompt, max_length=5, eos_token_id=[]), four)
    sampled = model.generate(prompt, max_new_tokens=4, eos_token_id=[], do_sample=True, seed=1, num_return_sequences=2)
    np.testing.assert_array_equal(sampled, model.generate(np.repeat(prompt, 2, axis=0), max_new_tokens=4,
                                                          eos_token_id=[], do_sample=True, seed=1))
    with pytest.raises(InputError, match="takes no num_bems"):
        model.generate(prompt, num_bems=2)


def test_labels_shift_and_errors():
    """Decoder inputs come from labels shifted right (-100 -> pad); mBART wraps the last non-pad label first;
    a config option that is not implemented is refused by name."""
    from vkformers_t5.variants import UnsupportedConfigError, seq2seq_spec
    def built(name):  # from the config alone: shifting needs no weights
        return AutoModelForSeq2SeqLM.from_config(json.loads((FIXTURES / name / "config.json").read_text()))

    assert built("bart").shift_right(np.array([[5, 6, -100, 7]])).tolist() == [[2, 5, 6, 0]]
    mbart = built("mbart")
    assert mbart.shift_right(np.array([[5, 6, 9, -100]])).tolist() == [[9, 5, 6, 9]]
    fsmt = built("fsmt")  # separate vocabularies: the encoder's table has the source size, no shared table
    assert dict(fsmt.named_slots())["model.encoder.embed_tokens.weight"].shape == (56, 32) and fsmt.shared is None
    assert fsmt.shift_right(np.array([[5, 6, 9, -100]])).tolist() == [[9, 5, 6, 9]]
    config = json.loads((FIXTURES / "marian" / "config.json").read_text())
    with pytest.raises(UnsupportedConfigError, match="share_encoder_decoder_embeddings"):
        seq2seq_spec(dict(config, share_encoder_decoder_embeddings=False), "marian")
    switch = json.loads((FIXTURES / "switch_transformers" / "config.json").read_text())
    assert seq2seq_spec(switch, "switch_transformers").encoder_sparse == (False, True)
    with pytest.raises(UnsupportedConfigError, match="router_dtype"):
        seq2seq_spec(dict(switch, router_dtype="bfloat16"), "switch_transformers")
    pegasus_x = built("pegasus_x")  # block_size 16, staggered: 8 tokens fit one local block, 9 do not
    with pytest.raises(vkf.VkformersError, match="local attention"):
        pegasus_x.encode(np.full((1, 9), 5))
    bigbird = json.loads((FIXTURES / "bigbird_pegasus" / "config.json").read_text())
    with pytest.raises(UnsupportedConfigError, match="attention_type='block_sparse'.*original_full"):
        seq2seq_spec(dict(bigbird, attention_type="block_sparse"), "bigbird_pegasus")
    t5gemma = json.loads((FIXTURES / "t5gemma" / "config.json").read_text())
    assert built("t5gemma").shift_right(np.array([[5, -100, 7]])).tolist() == [[1, 5, 0]]  # decoder.bos_token_id
    with pytest.raises(UnsupportedConfigError, match="encoder and decoder differ in hidden_size"):
        seq2seq_spec(dict(t5gemma, encoder=dict(t5gemma["encoder"], hidden_size=64)), "t5_gemma_module")
    with pytest.raises(UnsupportedConfigError, match="stack config alone"):
        seq2seq_spec(t5gemma["decoder"], "t5_gemma_module")
    t5gemma2 = json.loads((FIXTURES / "t5gemma2" / "config.json").read_text())
    assert built("t5gemma2").shift_right(np.array([[5, -100, 7]])).tolist() == [[1, 5, 0]]  # decoder.bos_token_id
    assert seq2seq_spec(t5gemma2, "t5gemma2").eoi_token_id == 5
    with pytest.raises(UnsupportedConfigError, match="encoder.text_config"):
        seq2seq_spec(dict(t5gemma2, encoder=t5gemma2["encoder"]["text_config"]), "t5gemma2")
    with pytest.raises(UnsupportedConfigError, match="differ in vocab_size"):
        seq2seq_spec(dict(t5gemma2, decoder=dict(t5gemma2["decoder"], vocab_size=30)), "t5gemma2")
    longt5 = json.loads((FIXTURES / "longt5_tglobal" / "config.json").read_text())
    assert seq2seq_spec(longt5, "longt5").transient_global_block == 4
    with pytest.raises(UnsupportedConfigError, match="encoder_attention_type='global'"):
        seq2seq_spec(dict(longt5, encoder_attention_type="global"), "longt5")
    nllb = json.loads((FIXTURES / "nllb-moe" / "config.json").read_text())
    assert seq2seq_spec(nllb, "nllb-moe").encoder_sparse == (False, True)
    for option, value in (("second_expert_policy", "sampling"), ("output_router_logits", True),
                          ("batch_prioritized_routing", True)):
        with pytest.raises(UnsupportedConfigError, match=option):
            seq2seq_spec(dict(nllb, **{option: value}), "nllb-moe")
    # batch-prioritised routing only reorders the capacity drops: without drops it is the same model
    seq2seq_spec(dict(nllb, batch_prioritized_routing=True, moe_eval_capacity_token_fraction=1.0), "nllb-moe")
    prophetnet = json.loads((FIXTURES / "prophetnet" / "config.json").read_text())
    assert seq2seq_spec(prophetnet, "prophetnet").ngram == 2
    with pytest.raises(UnsupportedConfigError, match="head counts differ"):
        seq2seq_spec(dict(prophetnet, num_decoder_attention_heads=4), "prophetnet")
    with pytest.raises(UnsupportedConfigError, match="ngram=0"):
        seq2seq_spec(dict(prophetnet, ngram=0), "prophetnet")
    assert not seq2seq_spec(dict(prophetnet, add_cross_attention=False), "prophetnet").cross_attention
    with pytest.raises(UnsupportedConfigError, match="add_cross_attention"):  # a decoder alone: AutoModelForCausalLM
        AutoModelForSeq2SeqLM.from_config(dict(prophetnet, add_cross_attention=False))
    with pytest.raises(UnsupportedConfigError, match="feed_forward_proj"):
        seq2seq_spec(dict(json.loads((FIXTURES / "t5" / "config.json").read_text()), feed_forward_proj="a-b-c"), "t5")


def test_led_global_projections_run_only_with_global_tokens():
    """LED without a global_attention_mask is sliding-window attention alone: query/key/value_global get no
    gradient (as in transformers, which then never runs them); a pad token marked global is not; another
    architecture refuses the mask by name."""
    case = Case.get("led")
    model = AutoModelForSeq2SeqLM.from_pretrained(case.folder, dtype="float32")
    out = model(case.ref["input_ids"].astype(np.int64), attention_mask=case.ref["attention_mask"],
                labels=case.ref["labels"].astype(np.int64))
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    global_names = [n for n in grads if "_global." in n]
    assert global_names and all(grads[n] is None for n in global_names)
    assert all(grads[n] is not None for n in grads if n not in global_names)
    marked = case.ref["global_attention_mask"].astype(np.int64)
    marked[1, -1] = 1  # a pad token: transformers merges the masks, so it takes no global attention
    with vkf.no_grad():
        logits = model(case.ref["input_ids"].astype(np.int64), attention_mask=case.ref["attention_mask"],
                       labels=case.ref["labels"].astype(np.int64), global_attention_mask=marked).logits.numpy()
    assert np.abs(logits - case.ref["logits"]).max() <= LOGITS_ATOL
    bart = AutoModelForSeq2SeqLM.from_pretrained(FIXTURES / "bart", dtype="float32", requires_grad=False)
    with pytest.raises(vkf.VkformersError, match="global_attention_mask"):
        bart(case.ref["input_ids"].astype(np.int64), labels=case.ref["labels"].astype(np.int64),
             global_attention_mask=np.zeros((2, 8), np.int64))


@pytest.mark.parametrize("name", ["marian", "switch_transformers", "nllb-moe", "longt5_tglobal", "led", "prophetnet"])
def test_bfloat16_forward_runs_close_to_float32(name):
    """Loaded as bfloat16 (fixed float32 sinusoidal tables are cast to the model dtype; a mixture's router runs in
    float32, as transformers casts it): logits stay within bfloat16 rounding of transformers' float32 ones."""
    folder = FIXTURES / name
    ref = read_reference(folder / "reference.safetensors")
    model = AutoModelForSeq2SeqLM.from_pretrained(folder, dtype="bfloat16", requires_grad=False)
    extra = {"global_attention_mask": ref["global_attention_mask"]} if "global_attention_mask" in ref else {}
    out = model(ref["input_ids"].astype(np.int64), attention_mask=ref["attention_mask"],
                labels=ref["labels"].astype(np.int64), **extra)
    assert out.logits.dtype.name == "bfloat16"
    assert np.abs(out.logits.numpy() - ref["logits"]).max() < 0.25
    assert abs(out.loss.item() - float(ref["loss"])) < 0.02


def test_switch_packed_experts_match_transformers(monkeypatch):
    """Switch Transformers with every call's tokens packed expert by expert (PACK_MIN_TOKENS lowered to 1, as an
    encoder of 64 tokens or more runs): logits and every gradient against transformers, with the tolerances of
    test_logits and test_gradients (whose own run keeps the fixture's 16 tokens in place)."""
    pytest.importorskip("vkformers_t5")
    import vkformers_t5.seq2seq as seq2seq
    monkeypatch.setattr(seq2seq, "PACK_MIN_TOKENS", 1)
    packings = []
    pack = seq2seq.PackedRoutes.of
    monkeypatch.setattr(seq2seq.PackedRoutes, "of", lambda weights, k: packings.append(k) or pack(weights, k))
    case = Case("switch_transformers")  # a run of its own, not the cached one
    assert packings, "the packed path did not run"
    check_logits("switch_transformers", case)
    check_gradients("switch_transformers", case)
    check_gradient_presence("switch_transformers", case)


def test_nllb_moe_packed_experts_match_transformers(monkeypatch):
    """NLLB-MoE with every call's tokens packed expert by expert (PACK_MIN_TOKENS lowered to 1; the experts'
    biases picked per packed row): logits and every gradient against transformers, as test_logits and
    test_gradients check the unpacked run."""
    pytest.importorskip("vkformers_t5")
    import vkformers_t5.seq2seq as seq2seq
    monkeypatch.setattr(seq2seq, "PACK_MIN_TOKENS", 1)
    packings = []
    pack = seq2seq.PackedRoutes.of
    monkeypatch.setattr(seq2seq.PackedRoutes, "of", lambda weights, k: packings.append(k) or pack(weights, k))
    case = Case("nllb-moe")  # a run of its own, not the cached one
    assert packings == [2, 2], "the packed path did not run in both sparse layers"
    check_logits("nllb-moe", case)
    check_gradients("nllb-moe", case)
    check_gradient_presence("nllb-moe", case)


def test_switch_adamw_skips_the_experts_no_token_was_kept_for():
    """A training step as the trainer builds it (backward deferred, the update in the same graph): the experts
    transformers gives no gradient keep their weights exactly (no weight decay), the others move."""
    from vkformers.engine import lazy
    case = Case.get("switch_transformers")
    model = AutoModelForSeq2SeqLM.from_pretrained(case.folder, dtype="float32")
    params = dict(model.named_parameters())
    before = {n: p.numpy() for n, p in params.items()}
    with lazy.deferred_backward():
        model(case.ref["input_ids"].astype(np.int64), attention_mask=case.ref["attention_mask"],
              labels=case.ref["labels"].astype(np.int64)).loss.backward()
    AdamW(list(params.values()), lr=1e-2, weight_decay=0.01).step()
    realize([p.lazy for p in params.values()])
    unused = set(case.meta["params_without_grad"])
    assert unused, "the fixture routes a token to every expert: nothing to check"
    for n, p in params.items():
        moved = not np.array_equal(p.numpy(), before[n])
        assert moved != (n in unused), f"{n}: {'updated' if moved else 'left alone'}, unlike torch's AdamW"


def test_switch_skips_the_experts_no_token_chose():
    """Switch Transformers' sparse feed-forward on one token (a decoding step): the experts it did not choose
    are not run (their weights hold NaN here, which a product would spread through their zero routing weight),
    with and without gradients, and the output is unchanged."""
    pytest.importorskip("vkformers_t5")
    from vkformers_t5.seq2seq import SwitchMoE
    model = AutoModelForSeq2SeqLM.from_pretrained(FIXTURES / "switch_transformers", dtype="float32",
                                                  requires_grad=False)
    block = next(m for _, m in model.named_modules() if isinstance(m, SwitchMoE))
    arrays = {name: p.numpy() for name, p in block.named_parameters()}
    h = np.random.default_rng(2).standard_normal((1, 1, block.router.in_features)).astype(np.float32)
    with vkf.no_grad():
        want = block(vkf.tensor(h)).numpy()
    chosen = int(np.argmax(h.reshape(1, -1) @ arrays["router.classifier.weight"].T))
    poisoned = {name: np.full_like(a, np.nan) if name.startswith("experts.") and
                not name.startswith(f"experts.expert_{chosen}.") else a for name, a in arrays.items()}
    block.load_state_dict(poisoned, requires_grad=True)
    with vkf.no_grad():
        np.testing.assert_allclose(block(vkf.tensor(h)).numpy(), want, rtol=1e-6, atol=1e-6)
    x = vkf.tensor(h, requires_grad=True)
    out = block(x)
    out.sum().backward()
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-6, atol=1e-6)
    assert np.isfinite(x.grad.numpy()).all()


def test_encoder_decoder_from_two_pretrained_checkpoints(tmp_path):
    """EncoderDecoderModel.from_encoder_decoder_pretrained(encoder, decoder): the bert2bert fixture split into a BERT
    masked-LM folder (read as its base model) and a decoder folder saved as a plain BERT (no is_decoder); with the
    decoder's cross-attention in its checkpoint the model is the fixture's (transformers' logits and loss); without,
    the cross-attention starts fresh (normal(0, initializer_range), zero biases, LayerNorms at one), the rest is read."""
    folder = FIXTURES / "bert2bert"
    config = json.loads((folder / "config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    encoder_dir, decoder_dir, bare_dir = tmp_path / "encoder", tmp_path / "decoder", tmp_path / "bare"
    plain_decoder = {k: v for k, v in config["decoder"].items() if k not in ("is_decoder", "add_cross_attention")}
    for target, sub, arrays in (
            (encoder_dir, config["encoder"], {"bert." + k[len("encoder."):]: v for k, v in weights.items()
                                              if k.startswith("encoder.")}),
            (decoder_dir, plain_decoder, {k[len("decoder."):]: v for k, v in weights.items()
                                          if k.startswith("decoder.")}),
            (bare_dir, plain_decoder, {k[len("decoder."):]: v for k, v in weights.items()
                                       if k.startswith("decoder.") and "crossattention" not in k})):
        target.mkdir()
        (target / "config.json").write_text(json.dumps(sub))
        save_file(arrays, str(target / "model.safetensors"))
    ref = Case.get("bert2bert").ref
    tokens = dict(decoder_start_token_id=config["decoder_start_token_id"], pad_token_id=config["pad_token_id"])
    model = vkf.EncoderDecoderModel.from_encoder_decoder_pretrained(encoder_dir, decoder_dir, **tokens)
    assert model.config["decoder"]["is_decoder"] and model.config["decoder"]["add_cross_attention"]
    with vkf.no_grad():
        out = model(ref["input_ids"].astype(np.int64), attention_mask=ref["attention_mask"],
                    labels=ref["labels"].astype(np.int64))
    assert np.abs(out.logits.numpy() - ref["logits"]).max() <= LOGITS_ATOL
    assert abs(out.loss.item() - float(ref["loss"])) <= LOSS_RTOL * abs(float(ref["loss"]))
    fresh = vkf.EncoderDecoderModel.from_encoder_decoder_pretrained(encoder_dir, bare_dir, **tokens)
    params = {n: p.numpy() for n, p in fresh.named_parameters()}
    cross = [n for n in params if "crossattention" in n]
    assert cross and all(not np.array_equal(params[n], weights[n]) for n in cross if n.endswith("query.weight"))
    assert all((params[n] == 1).all() for n in cross if n.endswith("LayerNorm.weight"))
    assert all((params[n] == 0).all() for n in cross if n.endswith(".bias"))
    std = config["decoder"].get("initializer_range", 0.02)
    assert all(abs(params[n].std() - std) < std for n in cross if n.endswith("query.weight"))
    assert all(np.array_equal(params[n], weights[n]) for n in params if "crossattention" not in n)


def test_encoder_decoder_from_pretrained_widths_differ(tmp_path):
    """The bert2gpt2 fixture split in two folders (BERT of width 12, GPT-2 with cross-attention of width 8):
    enc_to_dec_proj starts fresh (normal(0, 0.02), zero bias); every other weight is read."""
    folder = FIXTURES / "bert2gpt2"
    config = json.loads((folder / "config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    for role, sub in (("encoder", config["encoder"]), ("decoder", config["decoder"])):
        (tmp_path / role).mkdir()
        (tmp_path / role / "config.json").write_text(json.dumps(sub))
        save_file({k[len(role) + 1:]: v for k, v in weights.items() if k.startswith(role + ".")},
                  str(tmp_path / role / "model.safetensors"))
    model = vkf.EncoderDecoderModel.from_encoder_decoder_pretrained(tmp_path / "encoder", tmp_path / "decoder")
    params = {n: p.numpy() for n, p in model.named_parameters()}
    assert params["enc_to_dec_proj.weight"].shape == (8, 12) and not params["enc_to_dec_proj.bias"].any()
    assert abs(params["enc_to_dec_proj.weight"].std() - 0.02) < 0.01
    assert all(np.array_equal(params[n], weights[n]) for n in params if not n.startswith("enc_to_dec_proj"))


def test_encoder_decoder_save_and_reload(tmp_path):
    """A saved EncoderDecoderModel folder (model_type encoder-decoder) loads back as the same model; a decoder
    without cross-attention is refused by name."""
    model = vkf.EncoderDecoderModel.from_pretrained(FIXTURES / "bert2bert")
    model.save_pretrained(tmp_path)
    again = vkf.EncoderDecoderModel.from_pretrained(tmp_path)
    ours = {n: p.numpy() for n, p in again.named_parameters()}
    assert ours.keys() == {n for n, _ in model.named_parameters()}
    assert all(np.array_equal(ours[n], p.numpy()) for n, p in model.named_parameters())
    config = json.loads((FIXTURES / "bert2bert" / "config.json").read_text())
    with pytest.raises(UnsupportedEncoderDecoder, match="add_cross_attention"):
        AutoModelForSeq2SeqLM.from_config(dict(config, decoder=dict(config["decoder"], add_cross_attention=False)))



@pytest.mark.parametrize("name", ["bert2bert", "bert2gpt2"])
def test_encoder_decoder_generate_steps_one_token_over_the_cache(name, monkeypatch):
    """EncoderDecoderModel.generate feeds the decoder one token per step, after the ones its cache holds, and
    computes each layer's cross-attention keys and values once (test_greedy_tokens_with_cache compares the tokens
    and logits with transformers' and with the forward without a cache)."""
    model = Case.get(name).model
    decoder = model.decoder_model
    steps, fills = [], []
    forward, fill = decoder.forward, type(decoder).encoder_decoder_cache

    def recording_forward(ids, **kwargs):
        steps.append((np.asarray(ids).shape, kwargs["cache"].position))
        return forward(ids, **kwargs)

    def recording_fill(self, *args):
        cache = fill(self, *args)
        fills.append(len(cache.cross))
        return cache
    monkeypatch.setattr(decoder, "forward", recording_forward)
    monkeypatch.setattr(type(decoder), "encoder_decoder_cache", recording_fill)
    tokens = model.generate(Case.get(name).ref["input_ids"][:1].astype(np.int64), max_new_tokens=4, eos_token_id=[])
    assert tokens.shape == (1, 5)
    assert steps == [((1, 1), position) for position in range(4)]
    assert fills == [len(decoder.layers)]


def test_generate_passes_encoder_inputs_to_the_models_that_take_them():
    """generate hands LED's global_attention_mask to its encoder (the step logits change with it); a model whose
    encoder takes no such input refuses it by name."""
    case = Case.get("led")
    prompt, marked = case.ref["input_ids"][:1].astype(np.int64), case.ref["global_attention_mask"][:1].astype(np.int64)
    assert marked.any()
    _, plain = case.model.generate(prompt, max_new_tokens=2, eos_token_id=[], output_logits=True)
    _, global_ = case.model.generate(prompt, max_new_tokens=2, eos_token_id=[], output_logits=True,
                                     global_attention_mask=marked)
    assert np.abs(plain - global_).max() > 1e-3
    for name in ("bart", "bert2bert"):
        with pytest.raises(vkf.VkformersError, match="global_attention_mask.*leave it out"):
            Case.get(name).model.generate(prompt, max_new_tokens=2, global_attention_mask=marked)


def test_an_encoder_decoder_streams_its_tokens_as_transformers_hands_them():
    """generate(streamer=...): the decoder's start token first (put), then each step's token, then end(); a callable
    gets the new tokens only; beam search refuses a streamer, as transformers' does."""
    model = AutoModelForSeq2SeqLM.from_pretrained(FIXTURES / "t5", dtype="float32")
    ids = np.array([[5, 9, 12, 3, 1]])

    class Recorder:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, tokens):
            self.puts.append(np.asarray(tokens).reshape(-1).tolist())

        def end(self):
            self.ended = True
    recorder, called = Recorder(), []
    out = model.generate(ids, max_new_tokens=6, do_sample=False, streamer=recorder)
    assert recorder.ended and recorder.puts[0] == [int(out[0, 0])]
    assert [token for put in recorder.puts[1:] for token in put] == out[0, 1:].tolist()
    again = model.generate(ids, max_new_tokens=6, do_sample=False, streamer=lambda t: called.append(int(t[0])))
    assert called == again[0, 1:].tolist() == out[0, 1:].tolist()
    with pytest.raises(InputError, match="a streamer cannot follow beam search"):
        model.generate(ids, max_new_tokens=4, num_beams=2, streamer=Recorder())
