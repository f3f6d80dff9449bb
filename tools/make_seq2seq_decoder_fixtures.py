"""Write tests/fixtures/seq2seq-decoders/<name>/: an encoder-decoder's decoder run alone as a causal LM (transformers'
ProphetNetForCausalLM), tiny and random, plus what transformers computes for it.

The model (d_model 8, 2 heads, 2 decoder layers, ngram 2, vocabulary 24, cross-attention kept) is built from a config
(no network), re-initialised as tools/make_fixtures.py does (reinit_) and saved with save_pretrained. reference.safetensors
holds, for a [2, 8] batch whose row 1 is left-padded by 2 (attention_mask 0, labels -100 there and at one more place):
"logits", "loss" and the gradient of every parameter that has one ("grad.<name>"; meta.json lists the cross-attention's,
which no encoder states reach), the parameters after one AdamW step ("adamw.<name>",
stored as steps: tools/compact_adamw_fixtures.py); "clean.*": an unpadded batch given without a mask (logits, loss);
"cross.*": the padded batch attending to random encoder states with their own padding (logits); "greedy.*": 6 greedy
tokens with the cache from an unpadded prompt of 4 (tokens, each step's logits) and from a batch of two prompts, the
second left-padded by 2 ("padded_greedy.*"). tests/test_seq2seq_decoders.py loads the folder with vkformers'
AutoModelForCausalLM and compares. Needs transformers and torch (CPU):

    python tools/make_seq2seq_decoder_fixtures.py
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import transformers  # noqa: E402
from make_fixtures import ADAMW, reinit_, save_reference  # noqa: E402
from transformers import GenerationConfig, ProphetNetConfig, ProphetNetForCausalLM  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "seq2seq-decoders"
VOCAB, SEQ, LEFT_PAD, SOURCES, NEW = 24, 8, 2, 5, 6
PAD, BOS, EOS = 0, 1, 2
# num_encoder_layers = num_decoder_layers: transformers 5.24 sizes the decoder-only cache by the encoder's count
CONFIG = dict(vocab_size=VOCAB, hidden_size=8, encoder_ffn_dim=12, decoder_ffn_dim=12, num_encoder_layers=2,
              num_decoder_layers=2, num_encoder_attention_heads=2, num_decoder_attention_heads=2, ngram=2,
              num_buckets=8, relative_max_distance=16, max_position_embeddings=24, eps=0.1, dropout=0.0,
              attention_dropout=0.0, activation_dropout=0.0, init_std=0.2, pad_token_id=PAD, bos_token_id=BOS,
              eos_token_id=EOS, decoder_start_token_id=PAD)


def greedy(model, ids, mask):
    config = GenerationConfig(max_new_tokens=NEW, min_new_tokens=0, do_sample=False, num_beams=1, use_cache=True,
                              eos_token_id=None, pad_token_id=PAD, bos_token_id=BOS)
    saved, model.generation_config = model.generation_config, config
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, output_logits=True,
                             return_dict_in_generate=True)
    finally:
        model.generation_config = saved
    return out.sequences.to(torch.int32), torch.stack([step.float() for step in out.logits]).contiguous()


def build() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = ProphetNetForCausalLM(ProphetNetConfig(**CONFIG)).float().eval()
    reinit_(model)
    folder = OUT / "prophetnet"
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=g)
    mask = torch.ones(2, SEQ, dtype=torch.int64)
    ids[1, :LEFT_PAD], mask[1, :LEFT_PAD] = PAD, 0
    labels = torch.randint(3, VOCAB, (2, SEQ), generator=g)
    labels[1, :LEFT_PAD], labels[0, 3] = -100, -100
    ref = {"input_ids": ids.to(torch.int32), "attention_mask": mask.to(torch.int32), "labels": labels.to(torch.int32)}
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    ref["logits"], ref["loss"] = out.logits.detach().contiguous(), out.loss.detach().reshape(())
    params = dict(model.named_parameters())
    without_grad = [name for name, param in params.items() if param.grad is None]  # cross-attention: not run
    for name, param in params.items():
        if param.grad is not None:
            ref[f"grad.{name}"] = param.grad.detach().contiguous().clone()
    with torch.no_grad():
        clean = torch.randint(3, VOCAB, (2, SEQ), generator=g)
        run = model(input_ids=clean, labels=labels.clamp(min=3))
        ref.update({"clean.input_ids": clean.to(torch.int32), "clean.labels": labels.clamp(min=3).to(torch.int32),
                    "clean.logits": run.logits.contiguous(), "clean.loss": run.loss.reshape(())})
        states = torch.randn(2, SOURCES, CONFIG["hidden_size"], generator=g)
        source_mask = torch.ones(2, SOURCES, dtype=torch.int64)
        source_mask[1, -2:] = 0
        run = model(input_ids=ids, attention_mask=mask, encoder_hidden_states=states,
                    encoder_attention_mask=source_mask)
        ref.update({"cross.encoder_hidden_states": states, "cross.encoder_attention_mask": source_mask.to(torch.int32),
                    "cross.logits": run.logits.contiguous()})
        prompt = ids[:1, -4:]
        ref["greedy.input_ids"] = prompt.to(torch.int32)
        ref["greedy.tokens"], ref["greedy.logits"] = greedy(model, prompt, torch.ones_like(prompt))
        prompts, prompt_mask = ids[:, -5:].clone(), mask[:, -5:].clone()
        prompts[1, :LEFT_PAD], prompt_mask[1, :LEFT_PAD] = PAD, 0
        ref["padded_greedy.input_ids"], ref["padded_greedy.attention_mask"] = (prompts.to(torch.int32),
                                                                               prompt_mask.to(torch.int32))
        ref["padded_greedy.tokens"], ref["padded_greedy.logits"] = greedy(model, prompts, prompt_mask)
    torch.optim.AdamW(list(params.values()), foreach=False, **ADAMW).step()
    for name, param in params.items():
        ref[f"adamw.{name}"] = param.detach().contiguous().clone()
    save_reference({k: v.float() if v.dtype.is_floating_point else v for k, v in ref.items()}, folder)
    (folder / "meta.json").write_text(json.dumps({
        "fixture": "prophetnet", "model_class": type(model).__name__, "config_overrides": CONFIG,
        "transformers_version": transformers.__version__, "torch_version": torch.__version__,
        "parameters": list(params), "params_without_grad": without_grad, "adamw": {**ADAMW, "betas": list(ADAMW["betas"]), "foreach": False},
        "generation": {"max_new_tokens": NEW, "do_sample": False, "use_cache": True, "eos_token_id": None}},
        indent=1, sort_keys=True) + "\n")
    size = sum(f.stat().st_size for f in folder.iterdir())
    print(f"prophetnet: {type(model).__name__}, {size // 1024} KiB, loss {out.loss.item():.4f}")


if __name__ == "__main__":
    build()
