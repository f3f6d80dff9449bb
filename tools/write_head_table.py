#!/usr/bin/env python3
"""Write tests/fixtures/transformers_heads.json: for every registered model_type spelling, the task-head classes
transformers has for it and the parameters each head adds to its base model.

vkformers offers a sequence-classification, token-classification, question-answering or multiple-choice head only
where transformers has that class for the spelling (its MODEL_FOR_<TASK>_MAPPING_NAMES), so that every head has a
reference; tests/test_heads_table.py compares every spelling's declared heads with this table, both ways. The
spellings are core's generated table of every plugin's (core/vkformers/models/known_families.py). Each head class
is built on the meta device from transformers' default config of the spelling (no weights): where it keeps its base
model ("prefix") and the parameters it adds to it ("parameters"; both null where that config does not build).

Needs transformers and torch (the reference stack):

    python tools/write_head_table.py           # rewrite the fixture
    python tools/write_head_table.py --check   # exit 1 if it is out of step with the installed transformers
"""
from __future__ import annotations

import argparse
import json
import runpy
import sys
import warnings
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig
from transformers.models.auto import modeling_auto

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "tests" / "fixtures" / "transformers_heads.json"
SPELLINGS = ROOT / "core" / "vkformers" / "models" / "known_families.py"
# vkformers' task name -> transformers' mapping of model_type to that head's class
MAPPINGS = {
    "sequence-classification": modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    "token-classification": modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
    "question-answering": modeling_auto.MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES,
    "multiple-choice": modeling_auto.MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES,
}


def spellings() -> list[str]:
    """Every model_type a vkformers plugin in the repository registers (canonical names and aliases)."""
    return sorted(runpy.run_path(str(SPELLINGS))["KNOWN_FAMILIES"])


def default_config(model_type: str):
    """transformers' default config of ``model_type``, with the fields some defaults leave unset filled in so
    that the model builds."""
    config = AutoConfig.for_model(model_type)
    config.num_labels = 2  # DistilBERT's question-answering head insists on 2
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "num_key_value_heads", 0) is None:
        text.num_key_value_heads = text.num_attention_heads
    if getattr(text, "head_dim", 0) is None:
        text.head_dim = text.hidden_size // text.num_attention_heads
    if getattr(text, "vocab_size", 0) is None:
        text.vocab_size = 32
    if getattr(text, "rope_parameters", None) == {} and getattr(text, "layer_types", None):  # one per layer type
        text.rope_parameters = {kind: {"rope_type": "default", "rope_theta": 10000.0} for kind in text.layer_types}
    return config


def parameter_names(cls, config) -> set[str]:
    with torch.device("meta"):
        return {name for name, _ in cls(config).named_parameters()}


def head_layout(model_type: str, class_name: str) -> dict:
    """Where ``class_name`` keeps its base model ("prefix": its base_model_prefix, "" when the base's modules sit at
    the top, as T5ForQuestionAnswering's) and the parameters it adds to that base (AutoModel of ``model_type``);
    both None where transformers' default config does not build."""
    cls = getattr(transformers, class_name)
    try:
        config = default_config(model_type)
        names = parameter_names(cls, config)
        base_classes = modeling_auto.MODEL_MAPPING_NAMES.get(model_type, ())
        base = set()
        for base_class in (base_classes,) if isinstance(base_classes, str) else base_classes:  # Funnel's: two
            base |= parameter_names(getattr(transformers, base_class), config)
    except Exception:  # noqa: BLE001 - a default config that does not build: no layout to compare
        return {"prefix": None, "parameters": None}
    prefix = cls.base_model_prefix + "."
    if not any(name.startswith(prefix) for name in names):
        prefix = ""
    if base:
        head = (name for name in names if name.removeprefix(prefix) not in base)
    else:  # no AutoModel class: what is not under the prefix
        head = (name for name in names if not name.startswith(prefix))
    return {"prefix": prefix[:-1], "parameters": sorted(head)}


def table() -> dict:
    heads = {}
    for spelling in spellings():
        heads[spelling] = {task: {"class": mapping[spelling], **head_layout(spelling, mapping[spelling])}
                           for task, mapping in MAPPINGS.items() if spelling in mapping}
    return {"transformers": transformers.__version__, "written_by": "tools/write_head_table.py", "heads": heads}


def render(data: dict) -> str:
    """One line per spelling: small, and a change to one architecture is one line of diff."""
    lines = ["{", f'  "transformers": {json.dumps(data["transformers"])},',
             f'  "written_by": {json.dumps(data["written_by"])},', '  "heads": {']
    items = list(data["heads"].items())
    for i, (spelling, heads) in enumerate(items):
        lines.append(f"    {json.dumps(spelling)}: {json.dumps(heads)}{',' if i < len(items) - 1 else ''}")
    lines += ["  }", "}", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the fixture is out of step")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    text = render(table())
    if args.check:
        if TARGET.read_text() != text:
            print(f"{TARGET} is out of step: run python tools/write_head_table.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET.relative_to(ROOT)} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
