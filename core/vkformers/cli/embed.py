"""``vkformers embed``: sentence embeddings of texts with a sentence-transformers model (vkformers.SentenceTransformer)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from vkformers.cli.options import positive_int
from vkformers.errors import VkformersError
from vkformers.models.atomic import atomic_write
from vkformers.models.sentence import SentenceTransformer


class EmbedInputError(VkformersError, ValueError):
    """An input file vkformers embed cannot read texts from."""


def add_parser(subparsers):
    p = subparsers.add_parser("embed", help="sentence embeddings of texts (sentence-transformers models)",
                              description="Embeds each text with a sentence-transformers model folder or hub repo "
                                          "(modules.json: Transformer, Pooling, Dense, Normalize), as "
                                          "sentence-transformers' encode does.")
    p.add_argument("--model", required=True, help="sentence-transformers folder or hub repo id")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", action="append", help="a text to embed (repeat for several)")
    source.add_argument("--input", type=Path, help="a .txt file (one text per line) or .jsonl file (one JSON "
                                                   "string, or object with --text-field, per line)")
    p.add_argument("--text-field", default="text", help="the field of a .jsonl object holding the text "
                                                        "(default: text)")
    p.add_argument("--out", type=Path, help="output file: .npy (float32 [texts, dim]) or .jsonl ({text, "
                                            "embedding} per line); default: JSONL on stdout")
    p.add_argument("--batch-size", type=int, default=32, help="texts per batch (default 32)")
    p.add_argument("--normalize", action="store_true", help="scale each embedding to unit length")
    p.add_argument("--truncate-dim", type=positive_int, default=None,
                   help="keep each embedding's first N dimensions (Matryoshka models; before --normalize)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt-name", help="put the model's prompt of this name (config_sentence_transformers.json "
                                              "'prompts', e.g. query) before each text")
    prompt.add_argument("--prompt", help="put this text before each text (e.g. 'query: ')")
    p.add_argument("--dtype", default="float32", help="compute dtype (float32, bfloat16, float16)")
    p.set_defaults(func=run)
    return p


def read_texts(path: Path, field: str) -> list[str]:
    if not path.is_file():
        raise EmbedInputError(f"--input {path}: no such file")
    lines = path.read_text(encoding="utf-8-sig").splitlines()
    if path.suffix.lower() != ".jsonl":
        return [line for line in lines if line.strip()]
    texts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EmbedInputError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        text = record.get(field) if isinstance(record, dict) else record
        if not isinstance(text, str):
            raise EmbedInputError(f"{path}:{number}: no string field {field!r} (pass --text-field NAME)")
        texts.append(text)
    return texts


def run(args) -> int:
    texts = args.text if args.text else read_texts(args.input, args.text_field)
    if not texts:
        raise EmbedInputError(f"--input {args.input}: no texts in it")
    if args.out is not None and args.out.suffix.lower() not in (".npy", ".jsonl"):
        raise EmbedInputError(f"--out {args.out}: use a .npy or .jsonl file name")
    if args.batch_size < 1:
        raise EmbedInputError(f"--batch-size {args.batch_size}: pass a positive number")
    model = SentenceTransformer(args.model, dtype=args.dtype)
    embeddings = model.encode(texts, prompt_name=args.prompt_name, prompt=args.prompt, batch_size=args.batch_size,
                              normalize_embeddings=args.normalize, truncate_dim=args.truncate_dim,
                              show_progress_bar=sys.stderr.isatty())
    if args.out is not None and args.out.suffix.lower() == ".npy":
        with atomic_write(args.out, "wb") as f:
            np.save(f, embeddings)
    else:
        lines = "".join(json.dumps({"text": text, "embedding": [float(v) for v in row]}) + "\n"
                        for text, row in zip(texts, embeddings))
        if args.out is None:
            sys.stdout.write(lines)
        else:
            with atomic_write(args.out, "w") as f:
                f.write(lines)
    if args.out is not None:
        print(f"embedded {len(texts)} text(s), dimension {embeddings.shape[1]}: {args.out}", file=sys.stderr)
    return 0
