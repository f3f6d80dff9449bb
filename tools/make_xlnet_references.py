"""XLNet's two-stream and memory references: writes tests/fixtures/xlnet/streams.safetensors.

The decoder fixture (tools/make_fixtures.py --only xlnet) covers the content stream of a plain forward and
generate; this adds, on the same checkpoint, what that batch leaves unused (tests/test_xlnet.py compares them):

- ``two_stream.*``: the fixture's batch (row 1 left-padded by 2, with its attention_mask) with token_type_ids
  (segments 0 0 0 0 1 1 1 1), a perm_mask from a random factorization order per row ending with the targets (a token sees
  those before it in the order), target_mapping on the last two positions and their labels, as XLNet's pretraining loss uses
  them: the query stream's logits [2, 2, vocab], the loss and every parameter's gradient (mask_emb, r_s_bias and
  seg_embed included);
- ``mems.*``: a forward of the first 5 tokens with use_mems, then of the last 3 with those mems and token types:
  the second call's logits and its new mems (every layer's input, the last mem_len).

Run it after tools/make_fixtures.py --only xlnet (which rebuilds the folder without this file):

    python tools/make_xlnet_references.py      # with transformers 5.24 and torch
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import XLNetLMHeadModel

FOLDER = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "xlnet"
FILE = "streams.safetensors"
PREDICT = 2        # target_mapping picks the last PREDICT positions
SPLIT = 5          # the mems case: tokens [0, SPLIT) first, the rest with their mems


def factorization_mask(length: int, generator) -> torch.Tensor:
    """perm_mask of a random order whose last PREDICT steps are the targets (as XLNet's pretraining orders them):
    1 where query i may not see key j (j comes after i in the order, or is i)."""
    context = length - PREDICT
    order = torch.cat([torch.randperm(context, generator=generator),
                       context + torch.randperm(PREDICT, generator=generator)])
    rank = torch.empty(length, dtype=torch.long)
    rank[order] = torch.arange(length)
    return (rank[None, :] >= rank[:, None]).float()


def main() -> None:
    from safetensors.torch import load_file
    reference = load_file(str(FOLDER / "reference.safetensors"))
    ids = reference["input_ids"].long()
    mask = reference["attention_mask"].long()
    batch, length = ids.shape
    model = XLNetLMHeadModel.from_pretrained(FOLDER, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    types = torch.tensor([[0] * (length // 2) + [1] * (length - length // 2)] * batch)
    perm = torch.stack([factorization_mask(length, g) for _ in range(batch)])
    mapping = torch.zeros(batch, PREDICT, length)
    for k in range(PREDICT):
        mapping[:, k, length - PREDICT + k] = 1.0
    labels = ids[:, length - PREDICT:].contiguous()
    out = model(input_ids=ids, attention_mask=mask, token_type_ids=types, perm_mask=perm, target_mapping=mapping,
                labels=labels, use_mems=False)
    out.loss.backward()
    ref = {"two_stream.input_ids": ids.int(), "two_stream.attention_mask": mask.int(),
           "two_stream.token_type_ids": types.int(), "two_stream.perm_mask": perm, "two_stream.target_mapping": mapping,
           "two_stream.labels": labels.int(), "two_stream.logits": out.logits.detach().float(),
           "two_stream.loss": out.loss.detach().float().reshape(())}
    for name, p in model.named_parameters():
        if p.grad is None:
            sys.exit(f"{name} got no gradient: the two-stream case must reach every parameter")
        ref[f"two_stream.grad.{name}"] = p.grad.detach().float().clone()
    with torch.no_grad():
        first = model(input_ids=ids[:, :SPLIT], use_mems=True)
        second = model(input_ids=ids[:, SPLIT:], token_type_ids=types[:, SPLIT:], mems=first.mems, use_mems=True)
    ref["mems.token_type_ids"] = types[:, SPLIT:].int()
    ref["mems.logits"] = second.logits.float()
    for i, m in enumerate(second.mems):
        ref[f"mems.new.{i}"] = m.transpose(0, 1).contiguous().float()  # batch first, as vkformers keeps them
    save_file({k: v.contiguous() for k, v in ref.items()}, str(FOLDER / FILE),
              metadata={"split": str(SPLIT), "predict": str(PREDICT)})
    print(f"wrote {FOLDER / FILE}: loss {out.loss.item():.6f}")


if __name__ == "__main__":
    main()
