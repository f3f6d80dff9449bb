"""Replace the towers' tensors of tests/fixtures/wrappers/*/model.safetensors with one-element stand-ins.

vkformers runs a wrapper's language model alone and never reads its vision, audio or projector tensors, so their
values and shapes carry nothing the tests check; their names do (the loader must tell them from the language
model's). Run after tools/make_wrapper_fixtures.py, in vkformers' environment: which tensors belong to the language
model is decided by vkformers' own loader, so a tensor it would wrongly leave out stays a stand-in and the logits
test fails. reference.safetensors is untouched (transformers' outputs of the full model).

    python tools/slim_wrapper_fixtures.py [--fixtures tests/fixtures/wrappers] [--only llava,emu3]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from vkformers.models.loading import language_model_weights
from vkformers.models.safetensors_io import read_safetensors, write_safetensors

ROOT = Path(__file__).resolve().parent.parent
# Fixtures kept whole: {spelling: why the loader's wrapper table cannot tell their language model apart}
KEEP_WHOLE = {"cosmos3_omni": "its text model's tensors sit at the top level beside the towers (embed_tokens, "
                              "layers.*); the plugin's renames find them, not the wrapper table"}


def slim(path: Path) -> tuple[int, int]:
    """Rewrites ``path`` in place; returns (bytes before, bytes after)."""
    entries = read_safetensors(path)
    text_ids = {id(array) for array in language_model_weights({n: e.array for n, e in entries.items()}).values()}
    tensors, bfloat16 = {}, set()
    for name, entry in entries.items():
        array = entry.array
        if id(array) not in text_ids and array.size > 1:
            array = np.zeros((1,), array.dtype)
        tensors[name] = np.array(array)
        if entry.code == "BF16":
            bfloat16.add(name)
    before = path.stat().st_size
    write_safetensors(path, tensors, bfloat16=bfloat16)
    return before, path.stat().st_size


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", type=Path, default=ROOT / "tests" / "fixtures" / "wrappers")
    parser.add_argument("--only", default="")
    args = parser.parse_args(argv)
    only = {n for n in args.only.split(",") if n}
    for model in sorted(args.fixtures.glob("*/model.safetensors")):
        if (only and model.parent.name not in only) or model.parent.name in KEEP_WHOLE:
            continue
        before, after = slim(model)
        print(f"{model.parent.name:24s} {before:>9d} -> {after:>9d} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
