"""Write tests/data/generation_settings.json: transformers' greedy generate under generation settings and logits
processors (forced, banned and suppressed tokens, n-gram blocking, minimum lengths, a generation_config.json).

Also the probabilities transformers' sampling warpers (temperature, top-k, top-p, min-p) give fixed scores, and what
``return_dict_in_generate`` returns with ``output_scores`` and ``output_logits`` (each step's processed scores and
raw logits, and ``compute_transition_scores``) for a greedy call and for the first step of a sampling one.

Each case runs transformers' ``generate`` on a fixture's checkpoint (tests/fixtures/<fixture>), greedy, with the
keyword arguments given (beam search where they ask for it), after ``generation_config.json`` is replaced by the case's ``generation_config`` where
there is one (the fixture's own otherwise). tests/test_generation_settings.py runs vkformers the same way and
compares the tokens.

    /tmp/tfvenv/bin/python tools/make_generation_settings_reference.py
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "generation_settings.json"
DECODER_PROMPTS = [[0, 0, 9, 14, 9, 14, 9, 30], [5, 17, 22, 9, 14, 41, 3, 8]]  # row 0 left-padded (pad id 0)
DECODER_MASK = [[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8]
SEQ2SEQ_PROMPT = [[5, 17, 22, 9, 14, 41, 3, 8, 2]]
SEQ2SEQ_PROMPTS = [[5, 17, 22, 9, 14, 41, 3, 8, 2], [30, 12, 7, 7, 19, 25, 40, 33, 2]]
PLAIN = {"forced_eos_token_id": None}  # the cases' plain greedy run, to show that each case changes it
CASES = [
    # name, fixture, kind, generate's keyword arguments, generation_config.json (None: the fixture's)
    ("bart_config_forced_eos", "seq2seq/bart", "seq2seq", {"max_new_tokens": 8}, None),
    ("bart_forced_bos", "seq2seq/bart", "seq2seq", {"max_new_tokens": 6, "forced_bos_token_id": 7}, None),
    ("bart_no_repeat_bigrams", "seq2seq/bart", "seq2seq",
     {"max_new_tokens": 12, "no_repeat_ngram_size": 2, "forced_eos_token_id": None}, None),
    ("bart_bad_words", "seq2seq/bart", "seq2seq",
     {"max_new_tokens": 10, "bad_words_ids": [[11], [46, 46], [3, 4, 5]], "forced_eos_token_id": None}, None),
    ("bart_suppressed", "seq2seq/bart", "seq2seq",
     {"max_new_tokens": 8, "suppress_tokens": [11, 46], "begin_suppress_tokens": [7, 9],
      "forced_eos_token_id": None}, None),
    ("bart_min_length", "seq2seq/bart", "seq2seq", {"max_new_tokens": 10, "min_length": 7, "eos_token_id": 46},
     None),
    ("marian_generation_config", "seq2seq/marian", "seq2seq", {},
     {"decoder_start_token_id": 0, "eos_token_id": 2, "pad_token_id": 0, "bos_token_id": 1, "max_length": 9,
      "bad_words_ids": [[0]], "no_repeat_ngram_size": 2, "forced_eos_token_id": 2}),
    # beam search (encoder-decoders)
    ("bart_beams", "seq2seq/bart", "seq2seq", {"max_new_tokens": 8, "num_beams": 4}, None),
    ("bart_beams_two_prompts_eos", "seq2seq/bart", "seq2seq_batch",
     {"max_new_tokens": 9, "num_beams": 3, "num_return_sequences": 2, "eos_token_id": 1, "length_penalty": 2.0,
      "early_stopping": "never", "forced_eos_token_id": None}, None),
    ("bart_beams_early_stopping", "seq2seq/bart", "seq2seq_batch",
     {"max_new_tokens": 10, "num_beams": 2, "eos_token_id": [1, 29], "early_stopping": True,
      "length_penalty": 0.5}, None),
    ("marian_beams_generation_config", "seq2seq/marian", "seq2seq", {},
     {"decoder_start_token_id": 0, "eos_token_id": 2, "pad_token_id": 0, "bos_token_id": 1, "max_length": 10,
      "num_beams": 3, "length_penalty": 0.6, "bad_words_ids": [[0]], "no_repeat_ngram_size": 2,
      "repetition_penalty": 1.2, "min_new_tokens": 3}),
    # beam search (decoder-only, a left-padded batch)
    ("llama_beams", "llama", "decoder", {"max_new_tokens": 7, "num_beams": 3, "num_return_sequences": 2}, None),
    ("llama_beams_generation_config", "llama", "decoder", {},
     {"bos_token_id": 1, "eos_token_id": [43, 45], "pad_token_id": 0, "max_new_tokens": 8, "num_beams": 4,
      "length_penalty": 1.5, "early_stopping": "never", "no_repeat_ngram_size": 2}),
    ("llama_no_repeat_trigrams", "llama", "decoder", {"max_new_tokens": 10, "no_repeat_ngram_size": 3}, None),
    ("llama_bad_words", "llama", "decoder", {"max_new_tokens": 8, "bad_words_ids": [[28], [19, 43], [31]]}, None),
    # the caller's processing (CUSTOM: functions the test defines alike for numpy)
    ("llama_prefix_allowed", "llama", "decoder", {"max_new_tokens": 8, "custom": "prefix_even_odd"}, None),
    ("llama_prefix_allowed_beams", "llama", "decoder",
     {"max_new_tokens": 6, "num_beams": 3, "custom": "prefix_even_odd"}, None),
    ("llama_logits_processor", "llama", "decoder",
     {"max_new_tokens": 8, "repetition_penalty": 1.2, "custom": "boost_seven_ban_five"}, None),
    ("llama_stopping_criteria", "llama", "decoder", {"max_new_tokens": 12, "custom": "stop_after_28"}, None),
    ("llama_generation_config", "llama", "decoder", {},
     {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "max_new_tokens": 7, "min_new_tokens": 5,
      "repetition_penalty": 1.3, "suppress_tokens": [4], "begin_suppress_tokens": [5, 6],
      "forced_eos_token_id": 3}),
]


def custom_arguments(name: str) -> dict:
    """generate's arguments for a CUSTOM name: the same functions tests/test_generation_settings.py writes for numpy."""
    from transformers import LogitsProcessorList, StoppingCriteriaList
    if name == "prefix_even_odd":  # prompt 0 may take even tokens only, prompt 1 tokens below 30
        return {"prefix_allowed_tokens_fn": lambda batch_id, ids: list(range(0, 48, 2)) if batch_id == 0
                else list(range(30))}
    if name == "boost_seven_ban_five":
        def processor(ids, scores):
            scores = scores.clone()
            scores[:, 7] += 2.0
            scores[:, 5] = -float("inf")
            return scores
        return {"logits_processor": LogitsProcessorList([processor])}
    if name == "stop_after_28":  # a row stops once it produced token 28
        return {"stopping_criteria": StoppingCriteriaList([lambda ids, scores, **kw: ids[:, -1] == 28])}
    raise ValueError(name)


def run(case) -> list[list[int]]:
    name, fixture, kind, kwargs, generation_config = case
    kwargs = dict(kwargs)
    kwargs.update(custom_arguments(kwargs.pop("custom")) if "custom" in kwargs else {})
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        shutil.copytree(ROOT / "tests" / "fixtures" / fixture, folder)
        if generation_config is not None:
            (folder / "generation_config.json").write_text(json.dumps(generation_config))
        if kind.startswith("seq2seq"):
            model = AutoModelForSeq2SeqLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32)
            ids = torch.tensor(SEQ2SEQ_PROMPTS if kind == "seq2seq_batch" else SEQ2SEQ_PROMPT)
            out = model.eval().generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                        **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32)
            ids = torch.tensor(DECODER_PROMPTS)
            out = model.eval().generate(input_ids=ids, attention_mask=torch.tensor(DECODER_MASK), do_sample=False,
                                        **kwargs)
    return out.tolist()


# sampling warpers on fixed scores (a row of 12 logits, one with ties), in the order transformers' generate runs
# them: temperature, top-k, top-p, min-p, typical, epsilon, eta; each case's probabilities after softmax
WARPER_SCORES = [[2.0, 1.5, 1.5, 0.3, -0.2, -1.0, 0.9, 0.9, -3.0, 1.2, 0.0, -0.5],
                 [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2]]
WARPER_CASES = [
    {"temperature": 0.7, "top_k": 50, "top_p": 1.0, "min_p": 0.0},
    {"temperature": 1.0, "top_k": 5, "top_p": 0.8, "min_p": 0.0},
    {"temperature": 1.3, "top_k": 0, "top_p": 1.0, "min_p": 0.2},
    {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05},
    {"temperature": 1.0, "top_k": 0, "top_p": 0.5, "min_p": 0.5},
    # the warpers after min-p: typical, epsilon and eta cutoffs
    {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 0.5},
    {"temperature": 0.8, "top_k": 10, "top_p": 1.0, "min_p": 0.0, "typical_p": 0.9},
    {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "epsilon_cutoff": 0.05},
    {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "eta_cutoff": 0.02},
    {"temperature": 0.7, "top_k": 0, "top_p": 0.95, "min_p": 0.0, "typical_p": 0.8, "epsilon_cutoff": 0.01,
     "eta_cutoff": 0.05},
]


def warper_probabilities(case) -> list:
    from transformers.generation.logits_process import (EpsilonLogitsWarper, EtaLogitsWarper, MinPLogitsWarper,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
                                                        TypicalLogitsWarper)
    scores = torch.tensor(WARPER_SCORES, dtype=torch.float32)
    ids = torch.zeros((len(WARPER_SCORES), 1), dtype=torch.int64)
    warpers = [TemperatureLogitsWarper(case["temperature"])]
    if case["top_k"]:
        warpers.append(TopKLogitsWarper(case["top_k"]))
    if case["top_p"] < 1.0:
        warpers.append(TopPLogitsWarper(case["top_p"]))
    if case["min_p"]:
        warpers.append(MinPLogitsWarper(case["min_p"]))
    if case.get("typical_p", 1.0) < 1.0:
        warpers.append(TypicalLogitsWarper(case["typical_p"]))
    if case.get("epsilon_cutoff"):
        warpers.append(EpsilonLogitsWarper(case["epsilon_cutoff"]))
    if case.get("eta_cutoff"):
        warpers.append(EtaLogitsWarper(case["eta_cutoff"]))
    for warper in warpers:
        scores = warper(ids, scores)
    return torch.softmax(scores, dim=-1).tolist()


OUTPUT_CASES = [
    # name, generate's keyword arguments (the llama fixture, the left-padded prompts)
    ("greedy_processed", {"max_new_tokens": 6, "repetition_penalty": 1.3, "no_repeat_ngram_size": 2}),
    ("sampling_warped", {"max_new_tokens": 1, "do_sample": True, "temperature": 0.7, "top_k": 10, "top_p": 0.9}),
    ("sampling_cutoffs", {"max_new_tokens": 1, "do_sample": True, "temperature": 0.9, "top_k": 0, "typical_p": 0.9,
                          "epsilon_cutoff": 0.005, "eta_cutoff": 0.01}),
    # the caller's processor runs before the warpers: its boost is scaled by the temperature, top-k keeps its token
    ("sampling_logits_processor", {"max_new_tokens": 1, "do_sample": True, "temperature": 0.5, "top_k": 5,
                                   "custom": "boost_seven_ban_five"}),
]


def run_outputs(kwargs) -> dict:
    model = AutoModelForCausalLM.from_pretrained(ROOT / "tests" / "fixtures" / "llama", attn_implementation="eager",
                                                 dtype=torch.float32).eval()
    kwargs = dict(kwargs)
    kwargs.update(custom_arguments(kwargs.pop("custom")) if "custom" in kwargs else {})
    torch.manual_seed(0)
    out = model.generate(input_ids=torch.tensor(DECODER_PROMPTS), attention_mask=torch.tensor(DECODER_MASK),
                         return_dict_in_generate=True, output_scores=True, output_logits=True,
                         **({"do_sample": False} | kwargs))
    transition = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    return {"sequences": out.sequences.tolist(), "scores": [s.tolist() for s in out.scores],
            "logits": [s.tolist() for s in out.logits], "transition_scores": transition.tolist()}


def main():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    import transformers
    reference = {"transformers_version": transformers.__version__, "torch_version": torch.__version__,
                 "decoder_prompts": DECODER_PROMPTS, "decoder_mask": DECODER_MASK, "seq2seq_prompt": SEQ2SEQ_PROMPT,
                 "seq2seq_prompts": SEQ2SEQ_PROMPTS,
                 "cases": []}
    for case in CASES:
        name, fixture, kind, kwargs, generation_config = case
        tokens = run(case)
        lengths = ({k: v for k, v in kwargs.items() if k == "max_new_tokens"}
                   or {"max_new_tokens": len(tokens[0]) - (1 if kind.startswith("seq2seq") else 8)})
        plain = run((name, fixture, kind, {**PLAIN, **lengths}, None))
        reference["cases"].append({"name": name, "fixture": fixture, "kind": kind, "kwargs": kwargs,
                                   "generation_config": generation_config, "tokens": tokens})
        print(name, tokens, "plain:", plain, file=sys.stderr)
    reference["warper_scores"] = WARPER_SCORES
    reference["warpers"] = [{**case, "probabilities": warper_probabilities(case)} for case in WARPER_CASES]
    reference["outputs"] = [{"name": name, "kwargs": kwargs, **run_outputs(kwargs)} for name, kwargs in OUTPUT_CASES]
    OUT.write_text(json.dumps(reference, indent=1) + "\n")


if __name__ == "__main__":
    main()
