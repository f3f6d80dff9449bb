"""Write tests/data/pipeline/: a tiny random Llama with a byte-level BPE tokenizer and a chat template, and what
transformers' ``pipeline("text-generation")`` returns for it, for tests/test_pipelines.py.

Every case decodes greedily (``do_sample=False``: the pipeline's own default samples at temperature 0.7, whose
draws numpy and torch make differently): strings, a batch of strings padded together (``batch_size``), chats
(a new assistant turn, and one continuing the last assistant message), ``return_full_text=False``,
``return_tensors``, several sequences from beams, ``stop_sequence`` and ``prefix``.

    /tmp/tfvenv/bin/python tools/make_pipeline_reference.py
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, pipeline

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "pipeline"
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello, world! How are you today?",
          "Paris is the capital of France.", "GPUs run compute shaders through Vulkan.",
          "Once upon a time there was a small model.", "answer in one short line please"] * 30
SPECIALS = ["<|end|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CHAT = [{"role": "system", "content": "answer in one short line"}, {"role": "user", "content": "Hello, how are you?"}]
CONTINUED = CHAT + [{"role": "assistant", "content": "The capital"}]
CASES = [
    # name, inputs, call keyword arguments (do_sample=False added to each)
    ("string", "The quick brown", {"max_new_tokens": 8}),
    ("strings_batched", ["Paris is the", "Once upon a time there"], {"max_new_tokens": 6, "batch_size": 2,
                                                                     "return_full_text": False}),
    ("strings_one_by_one", ["Paris is the", "Once upon a time there"], {"max_new_tokens": 6}),
    ("chat", CHAT, {"max_new_tokens": 6}),
    ("chat_continued", CONTINUED, {"max_new_tokens": 5}),
    ("chats_new_text", [CHAT, CONTINUED], {"max_new_tokens": 4, "return_full_text": False}),
    ("tensors", "Hello, world", {"max_new_tokens": 5, "return_tensors": True}),
    ("beams", "GPUs run", {"max_new_tokens": 6, "num_beams": 3, "num_return_sequences": 2}),
    ("stop_sequence", "The quick brown", {"max_new_tokens": 12, "stop_sequence": "n"}),
    ("prefix", "lazy dog", {"max_new_tokens": 5, "prefix": "The quick brown fox jumps over the "}),
    ("special_tokens_kept", "Hello, world", {"max_new_tokens": 8, "skip_special_tokens": False}),
]


def main():
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    OUT.mkdir(parents=True, exist_ok=True)
    backend.save(str(OUT / "tokenizer.json"))
    (OUT / "tokenizer_config.json").write_text(json.dumps(
        {"clean_up_tokenization_spaces": False, "eos_token": "<|end|>", "pad_token": "<|pad|>",
         "chat_template": CHAT_TEMPLATE, "model_max_length": 128}, indent=1) + "\n")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=backend.get_vocab_size(), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=True, initializer_range=0.3,
                         bos_token_id=None, eos_token_id=backend.token_to_id("<|end|>"),
                         pad_token_id=backend.token_to_id("<|pad|>"))
    LlamaForCausalLM(config).save_pretrained(OUT)
    (OUT / "generation_config.json").unlink(missing_ok=True)  # the pipeline's defaults apply
    model = LlamaForCausalLM.from_pretrained(OUT, attn_implementation="eager", dtype=torch.float32).eval()
    pipe = pipeline("text-generation", model=model, tokenizer=AutoTokenizer.from_pretrained(OUT))
    cases = []
    for name, inputs, kwargs in CASES:
        out = pipe(inputs, do_sample=False, **kwargs)
        cases.append({"name": name, "inputs": inputs, "kwargs": kwargs, "output": out})
        print(name, out)
    import transformers
    (OUT / "outputs.json").write_text(json.dumps({"transformers_version": transformers.__version__,
                                                  "cases": cases}, ensure_ascii=False, indent=1) + "\n")


if __name__ == "__main__":
    main()
