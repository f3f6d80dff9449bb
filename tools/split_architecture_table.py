#!/usr/bin/env python3
"""One-off: split the reference architecture list into the four family plugins' tables.

Reads tests/data/hierarchos_architectures.tsv (model_type, canonical, notes) and writes
  plugins/<family>/vkformers_<family>/architectures.py   one table per family plugin
  core/vkformers/models/known_families.py                 every spelling -> family
as plain Python literals. Nothing reads the TSV at run time; after this first run
the generated files are maintained by hand.

Usage: python tools/split_architecture_table.py
"""
from __future__ import annotations

import csv
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TSV = REPO / "tests" / "data" / "hierarchos_architectures.tsv"

FAMILY_DESCRIPTIONS = {
    "llama": "dense causal decoders (no mixture of experts)",
    "moe": "mixture-of-experts causal decoders",
    "bert": "bidirectional encoders",
    "t5": "encoder-decoders",
}

# Bracketed alias targets: the keys from the root config down to the sub-config
# whose model_type names the backbone.
WRAPPER_PATHS = {
    "(nested text_config)": ("text_config",),
    "(nested thinker_config.text_config)": ("thinker_config", "text_config"),
    # The Seq2Seq composite: the decoder is what generates; the encoder is config["encoder"].
    "(nested encoder/decoder configs)": ("decoder",),
}

# Which plugin lists a wrapper. Resolution follows the nested config whatever plugin
# that is; this only picks where the spelling is listed and which plugin to suggest.
# The default is llama: most multimodal/speech wrappers carry a dense decoder.
WRAPPER_FAMILIES = {
    "encoder-decoder": "t5",
    "qwen3_omni_moe_thinker": "moe",  # typically qwen3_omni_moe_text -> qwen3_moe
    "qwen3_omni_moe": "moe",
    "kimi_k25": "moe",  # typically kimi_k2 -> deepseek_v3
    "glm46v": "moe",  # GLM-4.6V's text model is GLM-4.5-Air style MoE
    "modernvbert": "bert",  # ModernBERT text encoder
}

# Upstream's own claims, reworded so that nobody reads them as ours.
CLAIM_REWORDING = {
    "in COMPATIBILITY.md additional HF forward-logit fixtures": "upstream claims HF forward-logit fixtures",
    "in later README strict 2-step AdamW parity table": "upstream claims 2-step AdamW parity",
}

KIND_PREFIXES = [
    ("encoder-decoder", "encoder-decoder"),
    ("decoder (causal)", "causal-decoder"),
    ("encoder (bidirectional)", "encoder"),
    # roc_bert, bert-generation, megatron-bert: encoders that can be run causally (is_decoder).
    ("BERT-family (causality per config)", "encoder"),
]


def parse_canonical(notes: list[str]) -> dict:
    """Declared traits of a canonical row, from its ';'-separated notes."""
    kind_note = notes[0]
    kind = next(kind for prefix, kind in KIND_PREFIXES if kind_note.startswith(prefix))
    remaining = []
    qualifier = re.search(r"\((.*)\)", kind_note)
    if qualifier and qualifier.group(1) not in ("causal", "bidirectional"):  # the kind already says these
        remaining.append(qualifier.group(1).replace("native dense-text-encoder", "upstream native dense-text-encoder"))
    norms = set()
    moe = llama_layout = False
    for note in notes[1:]:
        norm_match = re.fullmatch(r"(RMSNorm|LayerNorm)(?: \((.*)\))?", note)
        if norm_match:
            norms.add("rms" if norm_match.group(1) == "RMSNorm" else "layer")
            if norm_match.group(2):
                remaining.append(f"{norm_match.group(2)} {norm_match.group(1)}")
        elif note == "MoE":
            moe = True
        elif note == "Llama-layout":
            llama_layout = True
        elif note == "non-Llama layout":
            pass
        else:
            remaining.append(CLAIM_REWORDING.get(note, note))
    assert len(norms) == 1, notes
    notes_text = "; ".join(dict.fromkeys(remaining))  # drop repeats, keep order
    return {"kind": kind, "norm": norms.pop(), "moe": moe, "llama_layout": llama_layout, "notes": notes_text}


def family_of(kind: str, moe: bool) -> str:
    if kind == "encoder":
        return "bert"
    if kind == "encoder-decoder":
        return "t5"
    return "moe" if moe else "llama"


def read_rows():
    with TSV.open(newline="") as handle:
        for row in csv.DictReader(handle, delimiter="\t"):
            status, *notes = [part.strip() for part in row["family_or_notes"].split(";")]
            if status.startswith("LATER-REVISION-ONLY"):
                continue  # not in the 143/224 snapshot we register
            yield row["model_type"], row["canonical"], status, notes


def split():
    canonicals: dict[str, dict] = {}
    aliases: list[tuple[str, str, str]] = []
    for model_type, canonical, status, notes in read_rows():
        if status == "CANONICAL":
            assert model_type == canonical
            traits = parse_canonical(notes)
            traits["family"] = family_of(traits["kind"], traits["moe"])
            canonicals[model_type] = traits
        else:
            assert status == "ALIAS", status
            aliases.append((model_type, canonical, "; ".join(CLAIM_REWORDING.get(n, n) for n in notes)))
    assert (len(canonicals), len(aliases)) == (143, 81), (len(canonicals), len(aliases))
    return canonicals, aliases


def literal(value) -> str:
    """Python source for a str, bool or tuple of str, with double-quoted strings."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple):
        return "(" + ", ".join(literal(item) for item in value) + ("," if len(value) == 1 else "") + ")"
    return repr(value)


def alias_target_code(target: str) -> str:
    if target not in WRAPPER_PATHS:
        return literal(target)
    path = WRAPPER_PATHS[target]
    return "NESTED_TEXT_CONFIG" if path == ("text_config",) else f"NestedConfig({literal(path)})"


def alias_comment(notes: str) -> str:
    # The target already says "nested text_config"; keep only what it does not say.
    notes = notes.replace("wrapper resolved dynamically from nested text_config.model_type; ", "")
    return notes.replace("generic multimodal/speech wrapper arm; non-text towers not executed", "generic multimodal/speech wrapper; non-text towers not run")


def render_plugin_table(family: str, rows: list[tuple[str, dict]], alias_rows: list[tuple[str, str, str]]) -> str:
    imports = sorted({name for _, target, _ in alias_rows for name in ("NESTED_TEXT_CONFIG", "NestedConfig") if name in alias_target_code(target)})
    lines = [
        f'"""Architectures provided by vkformers-{family}: {FAMILY_DESCRIPTIONS[family]}.',
        "",
        "First generated from tests/data/hierarchos_architectures.tsv by",
        "tools/split_architecture_table.py; edit this table by hand from now on",
        "(and keep core/vkformers/models/known_families.py in step).",
        "",
        "Traits are declared by the reference notes, not measured: every architecture",
        'here is "registered" until a test proves more.',
        '"""',
    ]
    if imports:
        lines.append(f"from vkformers.models.registry import {', '.join(imports)}")
    lines += ["", "# (name, kind, norm, moe, llama_layout, notes)", "ARCHITECTURES = ["]
    columns = [[literal(value) + "," for value in (name, t["kind"], t["norm"], t["moe"], t["llama_layout"])] for name, t in rows]
    widths = [max(len(row[i]) for row in columns) for i in range(5)]
    for row, (_, t) in zip(columns, rows):
        cells = " ".join(cell.ljust(width) for cell, width in zip(row, widths))
        lines.append(f"    ({cells} {literal(t['notes'])}),")
    lines += ["]", "", "# Other Hugging Face spellings that run as one of the architectures above.",
              "# NESTED_TEXT_CONFIG / NestedConfig: a wrapper whose backbone is the nested config's model_type."]
    if alias_rows:
        lines.append("ALIASES = {")
        key_width = max(len(literal(s)) for s, _, _ in alias_rows) + 1
        for spelling, target, notes in alias_rows:
            lines.append(f"    {(literal(spelling) + ':').ljust(key_width)} {alias_target_code(target)},  # {alias_comment(notes)}")
        lines.append("}")
    else:
        lines.append("ALIASES = {}")
    return "\n".join(lines) + "\n"


def render_known_families(spelling_families: dict[str, str]) -> str:
    lines = [
        '"""Which family plugin provides each known model_type spelling.',
        "",
        "Lets an error say `pip install vkformers-<family>` when that plugin is not",
        "installed. First generated by tools/split_architecture_table.py; keep it in",
        "step with the plugins' tables (tests/test_registry.py checks it).",
        '"""',
        "",
        "KNOWN_FAMILIES = {",
    ]
    for family in FAMILY_DESCRIPTIONS:
        lines.append(f"    # vkformers-{family}")
        lines += [f"    {literal(spelling)}: {literal(family)}," for spelling, f in spelling_families.items() if f == family]
    lines.append("}")
    return "\n".join(lines) + "\n"


def main() -> None:
    canonicals, aliases = split()
    spelling_families = {name: t["family"] for name, t in canonicals.items()}
    alias_family = {}
    for spelling, target, _ in aliases:
        if target in WRAPPER_PATHS:
            alias_family[spelling] = WRAPPER_FAMILIES.get(spelling, "llama")
        else:
            alias_family[spelling] = canonicals[target]["family"]
    spelling_families.update(alias_family)

    for family in FAMILY_DESCRIPTIONS:
        rows = [(name, t) for name, t in canonicals.items() if t["family"] == family]
        alias_rows = [a for a in aliases if alias_family[a[0]] == family]
        path = REPO / "plugins" / family / f"vkformers_{family}" / "architectures.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render_plugin_table(family, rows, alias_rows))
        print(f"{family}: {len(rows)} architectures, {len(alias_rows)} aliases -> {path.relative_to(REPO)}")

    path = REPO / "core" / "vkformers" / "models" / "known_families.py"
    path.write_text(render_known_families(spelling_families))
    print(f"{len(spelling_families)} spellings -> {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
