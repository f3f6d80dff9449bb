"""Write tests/data/assisted_generation.json and the assistant checkpoint tests/data/assisted/assistant: transformers'
assisted generate (prompt lookup, an assistant model) on the tiny Llama of tests/data/pipeline.

The assistant is that model cut to its first layer (its embeddings, tied head, final norm and layer 0): smaller, of
the same vocabulary, and agreeing with the main model's greedy tokens some of the time only, so that its drafts are
kept and rejected. Each case records the tokens and, per round of transformers' ``_assisted_decoding``, how many
draft tokens it verified and how many it kept (its candidate generator's ``update_candidate_strategy`` sees both),
with the plain greedy tokens, which assisted greedy decoding must reproduce. tests/test_assisted_generation.py runs
vkformers the same way.

transformers reads num_assistant_tokens, its schedule and assistant_confidence_threshold from the assistant's
generation config (it ignores them as generate arguments): the cases set them there. Without scikit-learn (as in the
environment this ran in) the confidence threshold stays fixed.

    /tmp/tfvenv/bin/python tools/make_assisted_generation_reference.py
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.generation import candidate_generator

ROOT = Path(__file__).resolve().parent.parent
MAIN = ROOT / "tests" / "data" / "pipeline"
ASSISTANT = ROOT / "tests" / "data" / "assisted" / "assistant"
OUT = ROOT / "tests" / "data" / "assisted_generation.json"
PROMPTS = [[5, 17, 22, 9, 14, 41, 3, 8, 5, 17, 22], [100, 200, 100, 200, 100, 200, 7], [42, 43, 44, 45, 46, 47, 48]]
CASES = [
    # name, generate's keyword arguments ("assistant": "small" or "self"), the assistant's generation config
    ("lookup", {"max_new_tokens": 24, "prompt_lookup_num_tokens": 4}, None),
    ("lookup_unigrams", {"max_new_tokens": 20, "prompt_lookup_num_tokens": 3, "max_matching_ngram_size": 1}, None),
    ("lookup_processors", {"max_new_tokens": 20, "prompt_lookup_num_tokens": 5, "no_repeat_ngram_size": 3,
                           "repetition_penalty": 1.2}, None),
    ("lookup_eos", {"max_new_tokens": 20, "prompt_lookup_num_tokens": 4, "eos_token_id": 22}, None),
    ("small_constant", {"max_new_tokens": 20, "assistant": "small"},
     {"num_assistant_tokens": 5, "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}),
    ("small_heuristic", {"max_new_tokens": 20, "assistant": "small"},
     {"num_assistant_tokens": 3, "num_assistant_tokens_schedule": "heuristic", "assistant_confidence_threshold": 0.0}),
    ("small_defaults", {"max_new_tokens": 16, "assistant": "small"}, None),
    ("small_confidence", {"max_new_tokens": 16, "assistant": "small"},
     {"num_assistant_tokens": 6, "assistant_confidence_threshold": 0.05}),
    ("self_all_kept", {"max_new_tokens": 20, "assistant": "self"},
     {"num_assistant_tokens": 6, "assistant_confidence_threshold": 0.0}),
]


def load_main():
    return AutoModelForCausalLM.from_pretrained(MAIN, attn_implementation="eager", dtype=torch.float32).eval()


def write_assistant() -> None:
    """The main model's first layer with its embeddings, tied head and final norm."""
    main = load_main()
    config = LlamaConfig(**{**main.config.to_dict(), "num_hidden_layers": 1})
    small = LlamaForCausalLM(config).eval()
    weights = {k: v for k, v in main.state_dict().items() if not k.startswith("model.layers.1.")}
    missing, unexpected = small.load_state_dict(weights, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    small.save_pretrained(ASSISTANT)
    generation = ASSISTANT / "generation_config.json"
    if generation.exists():  # the tests set the assistant's settings per call
        generation.unlink()


def load_assistant(which: str, main, generation_config: dict | None):
    assistant = main if which == "self" else AutoModelForCausalLM.from_pretrained(
        ASSISTANT, attn_implementation="eager", dtype=torch.float32).eval()
    if generation_config is not None and which != "self":
        for key, value in generation_config.items():
            setattr(assistant.generation_config, key, value)
    return assistant


def run(kwargs: dict, generation_config: dict | None, prompt: list[int]) -> dict:
    """One case on one prompt: the tokens, and per round (draft tokens verified, kept)."""
    main = load_main()
    kwargs = dict(kwargs)
    which = kwargs.pop("assistant", None)
    if which == "self":  # the main model as its own assistant: its generation config carries the settings
        main.generation_config.update(**generation_config)
    if which is not None:
        kwargs["assistant_model"] = load_assistant(which, main, generation_config)
    rounds = []
    originals = {}
    for cls in (candidate_generator.CandidateGenerator, candidate_generator.AssistedCandidateGenerator):
        original = originals[cls] = cls.__dict__["update_candidate_strategy"]

        def record(self, input_ids, scores, num_matches, _original=original):
            rounds.append([int(scores.shape[1]) - 1, int(num_matches)])
            return _original(self, input_ids, scores, num_matches)
        cls.update_candidate_strategy = record
    try:
        ids = torch.tensor([prompt])
        out = main.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, **kwargs)
    finally:
        for cls, original in originals.items():
            cls.update_candidate_strategy = original
    plain_kwargs = {k: v for k, v in kwargs.items() if k not in ("assistant_model", "prompt_lookup_num_tokens",
                                                                 "max_matching_ngram_size")}
    plain = load_main().generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, **plain_kwargs)
    return {"tokens": out[0].tolist(), "plain": plain[0].tolist(), "rounds": rounds}


def main():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    import transformers
    write_assistant()
    reference = {"transformers_version": transformers.__version__, "torch_version": torch.__version__,
                 "prompts": PROMPTS, "cases": []}
    for name, kwargs, generation_config in CASES:
        runs = [run(kwargs, generation_config, prompt) for prompt in PROMPTS]
        reference["cases"].append({"name": name, "kwargs": kwargs, "assistant_generation_config": generation_config,
                                   "runs": runs})
        kept = sum(k for r in runs for _, k in r["rounds"])
        drafted = sum(d for r in runs for d, _ in r["rounds"])
        same = all(r["tokens"] == r["plain"] for r in runs)
        print(f"{name}: {drafted} draft tokens verified, {kept} kept; tokens as plain greedy: {same}")
    OUT.write_text(json.dumps(reference, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)} and {ASSISTANT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
