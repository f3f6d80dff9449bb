"""``pipeline("text-generation", model=...)``: transformers' text-generation pipeline on a vkformers model.

    pipe = vkformers.pipeline("text-generation", model="HuggingFaceTB/SmolLM2-135M-Instruct")
    pipe("The capital of France is", max_new_tokens=20)      # [{"generated_text": "The capital of France is ..."}]
    pipe([{"role": "user", "content": "Hi!"}])                # the chat, its assistant turn appended

As transformers' TextGenerationPipeline: a string, a chat (a list of {"role", "content"} messages, rendered with
the tokenizer's chat template; a final assistant message is continued), or a list of them (then a list of
results). What the call and the model's generation config leave out takes the pipeline's defaults: 256 new tokens,
sampling at temperature 0.7 (the sampling ones only when sampling). ``batch_size`` prompts are padded on the left
and generated together. ``return_full_text`` (default True: the prompt's text, or chat, with the new text),
``return_tensors`` (the token ids instead), ``clean_up_tokenization_spaces``, ``skip_special_tokens`` (default
True), ``prefix``, ``stop_sequence``, ``continue_final_message``, ``add_special_tokens``, ``truncation``,
``max_length`` and ``handle_long_generation="hole"`` as transformers takes them; anything else goes to
``model.generate``.
"""
from __future__ import annotations

import numpy as np

from vkformers.errors import InputError
from vkformers.models.generation_settings import config_value, generation_sources
from vkformers.models.loading import AutoModelForCausalLM, AutoTokenizer

TASKS = ("text-generation",)
# The pipeline's own generation defaults (transformers' TextGenerationPipeline._default_generation_config)
GENERATION_DEFAULTS = {"max_new_tokens": 256, "do_sample": True, "temperature": 0.7}
SAMPLING_PARAMETERS = {"temperature", "top_k", "top_p", "min_p", "typical_p"}
# transformers' GenerationConfig defaults: a generation config holding one of these at this value does not set it
TRANSFORMERS_GENERATION_DEFAULTS = {"max_new_tokens": None, "max_length": 20, "do_sample": False, "temperature": 1.0,
                                    "top_k": 50, "top_p": 1.0, "min_p": None, "pad_token_id": None}
PIPELINE_OPTIONS = {"return_full_text", "return_tensors", "return_text", "clean_up_tokenization_spaces", "prefix",
                    "handle_long_generation", "stop_sequence", "truncation", "continue_final_message",
                    "skip_special_tokens", "add_special_tokens", "padding", "batch_size", "tokenizer_encode_kwargs"}


def pipeline(task: str, model=None, tokenizer=None, *, dtype=None, torch_dtype=None, device=None,
             device_map=None, **kwargs) -> "TextGenerationPipeline":
    """transformers' ``pipeline`` for the tasks of TASKS. ``model``: a checkpoint folder, hub repo id or .gguf
    file, or a loaded model; ``tokenizer``: the same, or None for the model's own. ``device``/``device_map`` are
    taken and ignored (the Vulkan device is VKFORMERS_DEVICE's); other keyword arguments are defaults of every call."""
    if task not in TASKS:
        raise InputError(f"pipeline: the task {task!r} is not offered; vkformers' pipelines: {', '.join(TASKS)}")
    if model is None:
        raise InputError("pipeline: give model= (a checkpoint folder, hub repo id or .gguf file, or a loaded model)")
    del device, device_map
    if isinstance(model, str):
        if tokenizer is None:
            tokenizer = model
        model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype or torch_dtype or "auto",
                                                     requires_grad=False)
    if tokenizer is None:
        tokenizer = getattr(model, "name_or_path", None)
        if tokenizer is None:
            raise InputError("pipeline: give tokenizer= for a model loaded without a checkpoint path")
    if isinstance(tokenizer, str):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    return TextGenerationPipeline(model, tokenizer, **kwargs)


def is_chat(value) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in value)


class TextGenerationPipeline:
    """See the module's docstring. ``kwargs``: defaults of every call (pipeline options and generate arguments)."""

    def __init__(self, model, tokenizer, **kwargs):
        self.model, self.tokenizer = model, tokenizer
        if getattr(tokenizer, "padding_side", "left") == "right":
            tokenizer.padding_side = "left"  # prompts of a batch end together
        self.defaults = kwargs

    def __call__(self, text_inputs, **kwargs):
        options = {**self.defaults, **kwargs}
        pipe = {name: options.pop(name) for name in PIPELINE_OPTIONS if name in options}
        if "max_length" in options:  # the tokenizer's limit and generate's, as transformers passes it to both
            pipe["max_length"] = options["max_length"]
        single = isinstance(text_inputs, str) or is_chat(text_inputs)
        prompts = [text_inputs] if single else list(text_inputs)
        if not prompts or not all(isinstance(p, str) or is_chat(p) for p in prompts):
            raise InputError("pipeline: give a string, a chat (a list of {'role', 'content'} messages) or a list of "
                             "them")
        return_type = self._return_type(pipe)
        batch_size = int(pipe.get("batch_size") or 1)
        if batch_size > 1 and self.tokenizer.pad_token_id is None:
            raise InputError("pipeline: batch_size > 1 pads the prompts, and the tokenizer has no pad token; set "
                             "tokenizer.pad_token (often to its eos token)")
        generate = self._generate_arguments(options, pipe)
        results = []
        for start in range(0, len(prompts), batch_size):
            group = prompts[start:start + batch_size]
            encoded = [self._encode(p, pipe, generate) for p in group]
            ids, mask = self._batch(encoded)
            sequences = np.asarray(self.model.generate(ids, attention_mask=mask, **generate))
            per_prompt = sequences.shape[0] // len(group)
            for index, prompt in enumerate(group):
                rows = sequences[index * per_prompt:(index + 1) * per_prompt]
                results.append([self._record(prompt, row, ids.shape[1], return_type, pipe) for row in rows])
        return results[0] if single else results

    # ---------------------------------------------------------------- the steps

    @staticmethod
    def _return_type(pipe: dict) -> str:
        full, tensors, text = pipe.get("return_full_text"), pipe.get("return_tensors"), pipe.get("return_text")
        if full is not None and (tensors is not None or text is not None):
            raise InputError("pipeline: return_full_text excludes return_tensors and return_text")
        if tensors is not None and text is not None:
            raise InputError("pipeline: return_text excludes return_tensors")
        if full is not None:
            return "full" if full else "new"
        return "tensors" if tensors else "full"

    def _generate_arguments(self, options: dict, pipe: dict) -> dict:
        """generate's keyword arguments: the call's, then the pipeline's defaults for what neither the call nor the
        model's generation config sets (the sampling ones only when sampling), as transformers' pipelines add them."""
        sources = generation_sources(self.model)
        configured = {name: value for name, default in TRANSFORMERS_GENERATION_DEFAULTS.items()
                      if (value := config_value(sources, name)) is not None and value != default}
        given = {**configured, **options}
        defaults = dict(GENERATION_DEFAULTS)
        if self.tokenizer.pad_token_id is not None:
            defaults["pad_token_id"] = self.tokenizer.pad_token_id
        added = {k: v for k, v in defaults.items()
                 if k not in given and not (k == "max_new_tokens" and "max_length" in given)}
        if not {**given, **added}.get("do_sample"):
            added = {k: v for k, v in added.items() if k not in SAMPLING_PARAMETERS}
        arguments = {**options, **added}
        stop = pipe.get("stop_sequence")
        if stop is not None:
            arguments["stop_strings"] = [stop] if isinstance(stop, str) else list(stop)
            arguments["tokenizer"] = self.tokenizer
        return arguments

    def _encode(self, prompt, pipe: dict, generate: dict) -> list[int]:
        """A prompt's token ids: a chat through the chat template (continuing a final assistant message unless
        continue_final_message says otherwise), a string with its prefix through the tokenizer."""
        encode = {k: pipe[k] for k in ("truncation", "padding") if k in pipe}
        if "max_length" in pipe:
            encode["max_length"] = pipe["max_length"]
        encode.update(pipe.get("tokenizer_encode_kwargs") or {})
        if is_chat(prompt):
            encode.pop("padding", None)
            continued = pipe.get("continue_final_message")
            if continued is None:
                continued = prompt[-1]["role"] == "assistant"
            ids = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=not continued,
                                                     continue_final_message=continued, return_dict=False, **encode)
        else:
            if "add_special_tokens" in pipe:
                encode["add_special_tokens"] = pipe["add_special_tokens"]
            prefix = pipe.get("prefix") or ""
            ids = self.tokenizer(prefix + prompt, **encode)["input_ids"]
            if prefix:  # a total length counts the prefix too
                length = len(self.tokenizer(prefix, add_special_tokens=bool(pipe.get("add_special_tokens", False)))
                             ["input_ids"])
                for total, new in (("max_length", "max_new_tokens"), ("min_length", "min_new_tokens")):
                    if total in generate and new not in generate:
                        generate[total] += length
        ids = [int(t) for t in np.asarray(ids).reshape(-1)]
        if pipe.get("handle_long_generation") not in (None, "hole"):
            raise InputError(f"pipeline: handle_long_generation={pipe['handle_long_generation']!r}; it takes None or "
                             "'hole'")
        if pipe.get("handle_long_generation") == "hole":
            new = generate.get("max_new_tokens")
            if new is None:
                new = generate["max_length"] - len(ids)
            limit = self.tokenizer.model_max_length
            if limit is not None and len(ids) + new > limit:
                keep = limit - new
                if keep <= 0:
                    raise InputError(f"pipeline: {new} new tokens do not fit the model's {limit} positions")
                ids = ids[-keep:]
        return ids

    def _batch(self, encoded: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """The prompts of one group, left-padded: ids and attention mask [group, width]."""
        width = max(len(e) for e in encoded)
        pad = self.tokenizer.pad_token_id if len(encoded) > 1 else 0
        ids = np.full((len(encoded), width), pad, np.int64)
        mask = np.zeros((len(encoded), width), np.int64)
        for row, tokens in enumerate(encoded):
            ids[row, width - len(tokens):] = tokens
            mask[row, width - len(tokens):] = 1
        return ids, mask

    def _record(self, prompt, sequence: np.ndarray, prompt_width: int, return_type: str, pipe: dict) -> dict:
        if return_type == "tensors":
            return {"generated_token_ids": [int(t) for t in sequence]}
        skip = pipe.get("skip_special_tokens")
        text = self.tokenizer.decode(sequence[prompt_width:].tolist(), skip_special_tokens=True if skip is None
                                     else skip, clean_up_tokenization_spaces=pipe.get("clean_up_tokenization_spaces"))
        if return_type == "new":
            return {"generated_text": text}
        if isinstance(prompt, str):
            return {"generated_text": prompt + text}
        continued = pipe.get("continue_final_message")
        if continued is None:
            continued = prompt[-1]["role"] == "assistant"
        messages = [dict(m) for m in prompt]
        if continued:
            messages[-1]["content"] = messages[-1]["content"] + text
        else:
            messages.append({"role": "assistant", "content": text})
        return {"generated_text": messages}
