"""``pipeline(task, model=...)``: transformers' pipelines on vkformers models, with their inputs, options and outputs:
text-generation, text-classification (sentiment-analysis), fill-mask, feature-extraction, token-classification (ner)
and zero-shot-classification.

    pipe = vkformers.pipeline("text-generation", model="HuggingFaceTB/SmolLM2-135M-Instruct")
    pipe("The capital of France is", max_new_tokens=20)      # [{"generated_text": "The capital of France is ..."}]
    pipe([{"role": "user", "content": "Hi!"}])                # the chat, its assistant turn appended

Text generation, as transformers' TextGenerationPipeline: a string, a chat (a list of {"role", "content"} messages,
rendered with the tokenizer's chat template; a final assistant message is continued), or a list of them (then a list
of results). What the call and the model's generation config leave out takes the pipeline's defaults: 256 new
tokens, sampling at temperature 0.7 (the sampling ones only when sampling). ``batch_size`` prompts are padded on the
left and generated together. ``return_full_text`` (default True: the prompt's text, or chat, with the new text),
``return_tensors`` (the token ids instead), ``clean_up_tokenization_spaces``, ``skip_special_tokens`` (default
True), ``prefix``, ``stop_sequence``, ``continue_final_message``, ``add_special_tokens``, ``truncation``,
``max_length`` and ``handle_long_generation="hole"`` as transformers takes them; anything else goes to
``model.generate``. The encoder tasks run a BERT-like model: see their classes.
"""
from __future__ import annotations

import numpy as np

from vkformers.errors import InputError
from vkformers.models.generation_settings import config_value, generation_sources
from vkformers.models.loading import (AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM,
                                      AutoModelForSequenceClassification, AutoModelForTokenClassification,
                                      AutoTokenizer)

TASKS = ("text-generation", "text-classification", "sentiment-analysis", "fill-mask", "feature-extraction",
         "token-classification", "ner", "zero-shot-classification")
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
             device_map=None, **kwargs):
    """transformers' ``pipeline`` for the tasks of TASKS. ``model``: a checkpoint folder, hub repo id or .gguf
    file, or a loaded model; ``tokenizer``: the same, or None for the model's own. ``device``/``device_map`` are
    taken and ignored (the Vulkan device is VKFORMERS_DEVICE's); other keyword arguments are defaults of every call."""
    if task not in TASKS:
        raise InputError(f"pipeline: the task {task!r} is not offered; vkformers' pipelines: {', '.join(TASKS)}")
    if model is None:
        raise InputError("pipeline: give model= (a checkpoint folder, hub repo id or .gguf file, or a loaded model)")
    del device, device_map
    kind, loader = PIPELINES[task]
    if isinstance(model, str):
        if tokenizer is None:
            tokenizer = model
        model = loader.from_pretrained(model, dtype=dtype or torch_dtype or "auto", requires_grad=False)
    if tokenizer is None:
        tokenizer = getattr(model, "name_or_path", None)
        if tokenizer is None:
            raise InputError("pipeline: give tokenizer= for a model loaded without a checkpoint path")
    if isinstance(tokenizer, str):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    return kind(model, tokenizer, **kwargs)


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


# ---------------------------------------------------------------- encoder tasks

def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


class EncoderPipeline:
    """What the encoder tasks share: each input tokenized (``batch_size`` of them padded together, on the right), one
    forward per batch, each row's output handed to ``_postprocess``. ``kwargs``: defaults of every call."""

    def __init__(self, model, tokenizer, **kwargs):
        self.model, self.tokenizer, self.defaults = model, tokenizer, kwargs

    def _run(self, items: list, tokenizer_kwargs: dict, batch_size, postprocess) -> list:
        results = []
        size = int(batch_size or 1)
        for start in range(0, len(items), size):
            group = items[start:start + size]
            texts = [item["text"] if isinstance(item, dict) else item for item in group]
            pairs = [item.get("text_pair") for item in group if isinstance(item, dict)]
            options = dict(tokenizer_kwargs)
            if len(group) > 1:  # on the right: each row's tokens keep their positions (postprocess reads them)
                options.update(padding=True, padding_side="right")
            if pairs and len(pairs) != len(group):
                raise InputError("pipeline: a batch mixes texts and text pairs; give batch_size=1 or one kind")
            encoded = self.tokenizer(texts, pairs or None, return_tensors="np", **options)
            inputs = {k: np.asarray(v) for k, v in encoded.items()
                      if k in ("input_ids", "attention_mask", "token_type_ids")}
            out = self.model(**inputs)
            for row in range(len(group)):
                results.append(postprocess(out, row, inputs["input_ids"][row], inputs["attention_mask"][row]))
        return results


class TextClassificationPipeline(EncoderPipeline):
    """transformers' text-classification: a text, a {"text", "text_pair"} dict or a list of them; ``top_k`` (default:
    the likeliest label alone, as a dict; None: every label; an int: that many, likeliest first, as lists),
    ``function_to_apply`` ("softmax", "sigmoid", "none"; default from the config's problem_type and labels); other
    keyword arguments go to the tokenizer (``truncation``, ``max_length``)."""

    def __call__(self, inputs, **kwargs):
        options = {**self.defaults, **kwargs}
        legacy = "top_k" not in options
        top_k = options.pop("top_k", 1)
        function = options.pop("function_to_apply", None)
        batch_size = options.pop("batch_size", None)
        items = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        for item in items:
            if not isinstance(item, (str, dict)) or (isinstance(item, dict) and "text" not in item):
                raise InputError("pipeline: text-classification takes texts, or {'text': ..., 'text_pair': ...} "
                                 "dicts for pairs")
        function = self._function(function)
        labels = {int(k): v for k, v in dict(self.model.config.get("id2label") or {}).items()}

        def postprocess(out, row, ids, mask):
            logits = np.asarray(out.logits.float().numpy()[row], np.float32)
            scores = {"sigmoid": sigmoid, "softmax": softmax, "none": lambda x: x}[function](logits)
            if top_k == 1 and legacy:
                return {"label": labels.get(int(scores.argmax()), f"LABEL_{int(scores.argmax())}"),
                        "score": float(scores.max())}
            ranked = [{"label": labels.get(i, f"LABEL_{i}"), "score": float(v)} for i, v in enumerate(scores)]
            if not legacy:
                ranked.sort(key=lambda r: r["score"], reverse=True)
                if top_k is not None:
                    ranked = ranked[:top_k]
            return ranked
        results = self._run(items, options, batch_size, postprocess)
        if isinstance(inputs, (list, tuple)):
            return results
        return [results[0]] if isinstance(inputs, str) and legacy else results[0]

    def _function(self, function) -> str:
        if function is not None:
            function = str(function).lower()
            if function not in ("sigmoid", "softmax", "none"):
                raise InputError(f"pipeline: function_to_apply={function!r}; it takes 'softmax', 'sigmoid' or 'none'")
            return function
        config = self.model.config
        problem, labels = config.get("problem_type"), int(config.get("num_labels") or len(config.get("id2label") or {}))
        if problem == "regression":
            return "none"
        if problem == "multi_label_classification" or labels == 1:
            return "sigmoid"
        if problem == "single_label_classification" or labels > 1:
            return "softmax"
        return "none"


class FillMaskPipeline(EncoderPipeline):
    """transformers' fill-mask: a text (or a list) holding the tokenizer's mask token; per mask the ``top_k``
    (default 5) likeliest tokens, each as {"score", "token", "token_str", "sequence"}; ``targets``: score only these
    words (those outside the vocabulary by their first token). Several masks in a text give a list per mask."""

    def __call__(self, inputs, **kwargs):
        options = {**self.defaults, **kwargs}
        top_k = options.pop("top_k", None) or 5
        targets = options.pop("targets", None)
        batch_size = options.pop("batch_size", None)
        tokenizer_kwargs = options.pop("tokenizer_kwargs", None) or {}
        if options:
            raise InputError(f"pipeline: fill-mask does not take {', '.join(sorted(options))}")
        mask_id = self.tokenizer.mask_token_id
        if mask_id is None:
            raise InputError("pipeline: the tokenizer has no mask token, which fill-mask needs")
        target_ids = None if targets is None else self._target_ids(targets)
        if target_ids is not None:
            top_k = min(top_k, len(target_ids))
        items = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        pad = self.tokenizer.pad_token_id

        def postprocess(out, row, ids, mask):
            ids = ids[mask.astype(bool)] if len(ids) != int(mask.sum()) else ids
            where = np.flatnonzero(ids == mask_id)
            if not len(where):
                raise InputError(f"pipeline: no mask token ({self.tokenizer.mask_token}) in the input")
            probs = softmax(np.asarray(out.logits.float().numpy()[row][where], np.float32))
            if target_ids is not None:
                probs = probs[:, target_ids]
            single = len(where) == 1
            result = []
            for position, p in zip(where, probs):
                order = np.argsort(-p, kind="stable")[:top_k]
                proposals = []
                for index in order:
                    token = int(target_ids[index]) if target_ids is not None else int(index)
                    filled = ids.copy()
                    filled[position] = token
                    filled = filled[filled != pad] if pad is not None else filled
                    proposals.append({"score": float(p[index]), "token": token,
                                      "token_str": self.tokenizer.decode([token]),
                                      "sequence": self.tokenizer.decode(filled.tolist(), skip_special_tokens=single)})
                result.append(proposals)
            return result[0] if single else result
        results = self._run(items, tokenizer_kwargs, batch_size, postprocess)
        if isinstance(inputs, (list, tuple)):
            return results[0] if len(results) == 1 else results
        return results[0]

    def _target_ids(self, targets) -> np.ndarray:
        """The ids of the target words, as transformers finds them (the vocabulary, else the first token)."""
        targets = [targets] if isinstance(targets, str) else list(targets)
        vocab = self.tokenizer.get_vocab()
        ids = []
        for target in targets:
            found = vocab.get(target)
            if found is None:
                pieces = self.tokenizer(target, add_special_tokens=False)["input_ids"]
                if not len(pieces):
                    continue
                found = int(pieces[0])
            ids.append(int(found))
        if not ids:
            raise InputError("pipeline: none of the fill-mask targets is a token of this tokenizer")
        return np.array(list(set(ids)))


class FeatureExtractionPipeline(EncoderPipeline):
    """transformers' feature-extraction: the model's last hidden states of a text, as nested lists [1, T, H] (a list
    of texts: a list of them); ``return_tensors=True``: numpy arrays instead; ``truncation`` and
    ``tokenize_kwargs`` go to the tokenizer."""

    def __call__(self, inputs, **kwargs):
        options = {**self.defaults, **kwargs}
        arrays = bool(options.pop("return_tensors", False))
        tokenizer_kwargs = dict(options.pop("tokenize_kwargs", None) or {})
        if "truncation" in options:
            tokenizer_kwargs["truncation"] = options.pop("truncation")
        batch_size = options.pop("batch_size", None)
        if options:
            raise InputError(f"pipeline: feature-extraction does not take {', '.join(sorted(options))}")
        items = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]

        def postprocess(out, row, ids, mask):
            states = out.last_hidden_state.float().numpy()[row]
            states = states[:int(mask.sum())][None]
            return states if arrays else states.tolist()
        results = self._run(items, tokenizer_kwargs, batch_size, postprocess)
        return results if isinstance(inputs, (list, tuple)) else results[0]


class TokenClassificationPipeline(EncoderPipeline):
    """transformers' token-classification (ner): a label per token of a text (or a list), as
    {"entity", "score", "index", "word", "start", "end"}; ``aggregation_strategy`` "simple" groups adjacent tokens
    of one entity ({"entity_group", "score", "word", "start", "end"}), "first", "average" and "max" first settle each
    word's label from its subword tokens; ``ignore_labels`` (default ["O"]) leaves those out."""

    STRATEGIES = ("none", "simple", "first", "average", "max")

    def __call__(self, inputs, **kwargs):
        options = {**self.defaults, **kwargs}
        strategy = str(options.pop("aggregation_strategy", None) or "none").lower()
        ignore = options.pop("ignore_labels", None)
        ignore = ["O"] if ignore is None else list(ignore)
        options.pop("batch_size", None)  # texts run one at a time: each has offsets of its own
        if strategy not in self.STRATEGIES:
            raise InputError(f"pipeline: aggregation_strategy={strategy!r}; it takes {', '.join(self.STRATEGIES)}")
        if options:
            raise InputError(f"pipeline: token-classification does not take {', '.join(sorted(options))} (text "
                             "split into words and long texts in strides are not offered)")
        items = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        if not all(isinstance(item, str) for item in items):
            raise InputError("pipeline: token-classification takes a text or a list of texts")
        labels = {int(k): v for k, v in dict(self.model.config.get("id2label") or {}).items()}
        results = []
        for text in items:  # one at a time: each row's offsets are its own text's
            limit = self.tokenizer.model_max_length
            encoded = self.tokenizer(text, return_tensors="np", truncation=bool(limit), return_special_tokens_mask=True,
                                     return_offsets_mapping=True)
            inputs_ = {k: np.asarray(encoded[k]) for k in ("input_ids", "attention_mask", "token_type_ids")
                       if k in encoded}
            logits = np.asarray(self.model(**inputs_).logits.float().numpy()[0], np.float32)
            scores = softmax(logits)
            pre = self._pre_entities(text, inputs_["input_ids"][0], scores, np.asarray(encoded["offset_mapping"])[0],
                                     np.asarray(encoded["special_tokens_mask"])[0])
            entities = self._aggregate(pre, strategy, labels)
            results.append([e for e in entities if e.get("entity") not in ignore and e.get("entity_group") not in
                            ignore])
        return results if isinstance(inputs, (list, tuple)) else results[0]

    def _pre_entities(self, text, ids, scores, offsets, special) -> list[dict]:
        prefix = getattr(self.tokenizer.backend.model, "continuing_subword_prefix", None)
        entities = []
        for index, token_scores in enumerate(scores):
            if special[index]:
                continue
            word = self.tokenizer.convert_ids_to_tokens(int(ids[index]))
            start, end = int(offsets[index][0]), int(offsets[index][1])
            reference = text[start:end]
            if prefix:
                subword = len(word) != len(reference)
            else:
                subword = start > 0 and " " not in text[start - 1:start + 1]
            if int(ids[index]) == self.tokenizer.unk_token_id:
                word, subword = reference, False
            entities.append({"word": word, "scores": token_scores, "start": start, "end": end, "index": index,
                             "is_subword": subword})
        return entities

    def _aggregate(self, pre: list[dict], strategy: str, labels: dict) -> list[dict]:
        if strategy in ("none", "simple"):
            entities = [{"entity": labels[int(e["scores"].argmax())], "score": float(e["scores"].max()),
                         "index": e["index"], "word": e["word"], "start": e["start"], "end": e["end"]} for e in pre]
        else:
            words, group = [], None
            for entity in pre:
                if group is None:
                    group = [entity]
                elif entity["is_subword"]:
                    group.append(entity)
                else:
                    words.append(self._word(group, strategy, labels))
                    group = [entity]
            if group is not None:
                words.append(self._word(group, strategy, labels))
            entities = words
        return entities if strategy == "none" else self._group(entities)

    def _word(self, pieces: list[dict], strategy: str, labels: dict) -> dict:
        """One word's label from its tokens: the first's, the most confident token's, or the average scores'."""
        if strategy == "first":
            scores = pieces[0]["scores"]
        elif strategy == "max":
            scores = max(pieces, key=lambda e: e["scores"].max())["scores"]
        else:
            scores = np.nanmean(np.stack([e["scores"] for e in pieces]), axis=0)
        best = int(scores.argmax())
        return {"entity": labels[best], "score": float(scores[best]),
                "word": self.tokenizer.convert_tokens_to_string([e["word"] for e in pieces]),
                "start": pieces[0]["start"], "end": pieces[-1]["end"]}

    def _group(self, entities: list[dict]) -> list[dict]:
        """Adjacent entities of one tag (a B- starts a new one) as one group, their scores averaged."""
        def tag(name):
            return ("B", name[2:]) if name.startswith("B-") else ("I", name[2:] if name.startswith("I-") else name)

        def merged(run):
            return {"entity_group": run[0]["entity"].split("-", 1)[-1],
                    "score": float(np.nanmean([e["score"] for e in run])),
                    "word": self.tokenizer.convert_tokens_to_string([e["word"] for e in run]),
                    "start": run[0]["start"], "end": run[-1]["end"]}
        groups, run = [], []
        for entity in entities:
            if run:
                bi, name = tag(entity["entity"])
                if not (name == tag(run[-1]["entity"])[1] and bi != "B"):
                    groups.append(merged(run))
                    run = []
            run.append(entity)
        if run:
            groups.append(merged(run))
        return groups


class ZeroShotClassificationPipeline(EncoderPipeline):
    """transformers' zero-shot-classification with an NLI classifier: each candidate label is put in
    ``hypothesis_template`` (default "This example is {}.") as the hypothesis of the text, and the label's score is
    its entailment logit's softmax over the labels (``multi_label``: entailment against contradiction, per label).
    Returns {"sequence", "labels", "scores"}, likeliest first (a list of texts: a list of them)."""

    def __call__(self, sequences, *args, **kwargs):
        options = {**self.defaults, **kwargs}
        if args:
            if len(args) > 1 or "candidate_labels" in options:
                raise InputError(f"pipeline: zero-shot-classification cannot read the arguments {args}")
            options["candidate_labels"] = args[0]
        labels = options.pop("candidate_labels", None)
        template = options.pop("hypothesis_template", "This example is {}.")
        multi = bool(options.pop("multi_label", False))
        options.pop("batch_size", None)
        if options:
            raise InputError(f"pipeline: zero-shot-classification does not take {', '.join(sorted(options))}")
        if isinstance(labels, str):
            labels = [label.strip() for label in labels.split(",") if label.strip()]
        texts = [sequences] if isinstance(sequences, str) else list(sequences)
        if not labels or not texts:
            raise InputError("pipeline: zero-shot-classification needs at least one text and one candidate label")
        if template.format(labels[0]) == template:
            raise InputError(f"pipeline: hypothesis_template {template!r} has no {{}} for the label to go in")
        entailment = next((int(i) for name, i in dict(self.model.config.get("label2id") or {}).items()
                           if name.lower().startswith("entail")), -1)
        contradiction = -1 if entailment == 0 else 0
        results = []
        for text in texts:
            logits = []
            for label in labels:  # each pair alone, the text truncated before the hypothesis
                encoded = self.tokenizer(text, template.format(label), return_tensors="np", truncation="only_first")
                inputs = {k: np.asarray(encoded[k]) for k in ("input_ids", "attention_mask", "token_type_ids")
                          if k in encoded}
                logits.append(np.asarray(self.model(**inputs).logits.float().numpy()[0], np.float32))
            logits = np.stack(logits)
            if multi or len(labels) == 1:
                pairs = np.exp(logits[:, [contradiction, entailment]])
                scores = (pairs / pairs.sum(-1, keepdims=True))[:, 1]
            else:
                entails = np.exp(logits[:, entailment])
                scores = entails / entails.sum()
            order = np.argsort(scores)[::-1]
            results.append({"sequence": text, "labels": [labels[i] for i in order],
                            "scores": [float(scores[i]) for i in order]})
        return results[0] if isinstance(sequences, str) else results


PIPELINES = {"text-generation": (TextGenerationPipeline, AutoModelForCausalLM),
             "text-classification": (TextClassificationPipeline, AutoModelForSequenceClassification),
             "sentiment-analysis": (TextClassificationPipeline, AutoModelForSequenceClassification),
             "fill-mask": (FillMaskPipeline, AutoModelForMaskedLM),
             "feature-extraction": (FeatureExtractionPipeline, AutoModel),
             "token-classification": (TokenClassificationPipeline, AutoModelForTokenClassification),
             "ner": (TokenClassificationPipeline, AutoModelForTokenClassification),
             "zero-shot-classification": (ZeroShotClassificationPipeline, AutoModelForSequenceClassification)}
