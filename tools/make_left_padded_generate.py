"""Write tests/data/left_padded_generate.safetensors: transformers' greedy generate of left-padded batches.

For the fixtures whose generate path once differed under left padding (positions generate gives a padded row,
what a decode step of DeepSeek-V4's compressed attention sees, MiniMax-M3's indexer blocks, TrOCR's own position
counting), transformers' generate on a batch of rows with different amounts of left padding, run on the fixture's
own checkpoint (tests/fixtures/<name>). tests/test_left_padded_generate.py compares vkformers against it.

    /tmp/tfvenv/bin/python tools/make_left_padded_generate.py

Keys per fixture: <name>.input_ids / <name>.attention_mask [rows, PROMPT] int32 (row 0 unpadded), <name>.tokens
[rows, PROMPT + NEW_TOKENS] int32 and <name>.logits [rows, NEW_TOKENS, vocab] float32 (the raw logits of each step).
The indexers' choices in these runs do meet ties (a left-padded row's pad tokens have equal keys): vkformers resolves
them as torch.topk does (vkformers_moe.torch_topk).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf  # noqa: E402  (the fixtures' vocabulary and pad id)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "left_padded_generate.safetensors"
PROMPT = 12
NEW_TOKENS = 8
# fixture -> (left pads of each row after the first, seed of the prompt's tokens)
CASES = {
    "deepseek_v4": ((5, 2), 0),
    "minimax_m3_vl_text": ((5, 3), 0),
    "trocr": ((3, 6), 0),
    "trocr_sinusoidal": ((3, 6), 0),
}


def batch(pads, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, mf.VOCAB, (1 + len(pads), PROMPT), generator=g, dtype=torch.int64)
    mask = torch.ones_like(ids)
    for row, count in enumerate(pads, start=1):
        ids[row, :count], mask[row, :count] = mf.PAD, 0
    return ids, mask


def main():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    out = {}
    for name, (pads, seed) in CASES.items():
        model = AutoModelForCausalLM.from_pretrained(ROOT / "tests" / "fixtures" / name, attn_implementation="eager",
                                                     dtype=torch.float32).eval()
        for module in model.modules():  # TrOCR's sinusoidal table is a plain attribute that loading leaves on
            if getattr(getattr(module, "weights", None), "is_meta", False):  # the meta device: rebuilt as at init
                size = model.config.max_position_embeddings + module.padding_idx + 1
                module.weights = module.get_embedding(size, module.embedding_dim, module.padding_idx)
        ids, mask = batch(pads, seed)
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                  use_cache=True, eos_token_id=None, pad_token_id=mf.PAD, num_beams=1,
                                  temperature=None, top_p=None, top_k=None, output_logits=True,
                                  return_dict_in_generate=True)
        model.generation_config.eos_token_id = None  # else generate fills it back in (see make_fixtures)
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        out[f"{name}.input_ids"] = ids.to(torch.int32)
        out[f"{name}.attention_mask"] = mask.to(torch.int32)
        out[f"{name}.tokens"] = gen.sequences.to(torch.int32).contiguous()
        out[f"{name}.logits"] = torch.stack([step.float() for step in gen.logits], dim=1).contiguous()
        print(f"{name}: {gen.sequences[:, PROMPT:].tolist()}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(OUT), metadata={"transformers": mf.transformers.__version__, "torch": torch.__version__})
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
