"""Padded-batch references for the decoder fixtures: writes tests/fixtures/<name>/padded.safetensors.

Reads each fixture folder that tools/make_fixtures.py wrote, rebuilds the same transformers model (same config,
seeds and re-initialisation, checked against the fixture's logits) and records, beside the fixture's own files:

- ``generate_tokens`` [2, 8 + 12] int32 / ``generate_logits`` [12, 2, vocab]: transformers' cached greedy
  ``generate`` on the fixture's batch itself (row 1 left-padded by 2, with its attention_mask), eos off, and the
  raw logits of every step;
- ``pad_grad_input_ids`` / ``pad_grad_attention_mask`` / ``pad_grad_labels`` [2, 8]: the fixture's batch with the
  pad id also as a real, attended token of row 0 (position 4), ``pad_grad_loss`` [] and ``pad_grad_embedding_row``
  [embedding width]: the loss and the gradient of the token embedding's pad-id row. Where transformers builds the
  embedding with ``padding_idx`` (Llama and most others) no lookup passes gradient into that row and only a tied
  LM head's share is left; where it does not (GPT-2's wte) every lookup does. The fixtures' own batch cannot show
  the difference: the pad id appears only at padded positions, which reach no loss term either way.

``index.json`` gets, per fixture entry, ``padding_idx`` (the padding_idx of the token embedding, null when
transformers builds it without one) and ``padded_generate_pad_invariant``: whether transformers' padded generate
gives each row what it gives that row alone, unpadded (the logits within 1e-4 and the same tokens); and, for a spec
with ``generate_rows_apart`` (transformers' batched generate wrong for the model: RWKV), that reason as
``padded_generate_rows_apart``: its ``generate_*`` are each row of the padded batch generated alone, pads included;
for one with ``padded_generate_uncached`` (transformers' cached decode wrong on padded rows: MiniMax), that reason:
its ``generate_*`` come from generate with use_cache=False, each step a full forward with the mask.

Run it after tools/make_fixtures.py (a rebuilt fixture folder loses its padded.safetensors):

    /tmp/tfvenv/bin/python tools/make_padded_references.py                 # every fixture
    /tmp/tfvenv/bin/python tools/make_padded_references.py --only llama,gpt2
    /tmp/tfvenv/bin/python tools/make_padded_references.py --encoders      # tests/fixtures/encoders/<name>/
    /tmp/tfvenv/bin/python tools/make_padded_references.py --seq2seq       # tests/fixtures/seq2seq/<name>/

For an encoder fixture it writes only the pad-row gradient batch (``pad_grad_input_ids``: the fixture's batch with
the pad id at row 0's position 4; its attention_mask, labels and token types are the fixture's), ``pad_grad_loss``
(the masked-LM cross-entropy) and ``pad_grad_embedding_row``; its safetensors metadata holds the padding_idx.
For an encoder-decoder fixture: ``generate_tokens`` [2, 1 + 8] / ``generate_logits`` [8, 2, vocab], greedy generate
from both rows of the fixture's batch at once (row 1 right-padded by 2, with its attention_mask), eos off; the
metadata says whether that is pad-invariant (each row as generated alone). Their pad rows need no extra batch: the
fixtures' decoder inputs already hold the pad id as a real token (a shifted -100 label).
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, CONFIG_MAPPING

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf  # noqa: E402  (the fixtures' sizes, specs, inputs and initialisation)

FILE = "padded.safetensors"
PAD_AS_TOKEN_AT = 4          # row 0's position that holds the pad id as a real token in the gradient batch
PAD_INVARIANT_ATOL = 1e-4


def rebuild(spec: mf.Spec, folder: Path):
    """The fixture's transformers model with the fixture's weights (make_fixtures.build's construction)."""
    torch.manual_seed(0)
    config = CONFIG_MAPPING[spec.model_type](**spec.overrides)
    if spec.model_class:
        cls = getattr(transformers, spec.model_class, None) or mf.LOCAL_MODEL_CLASSES[spec.model_class]()
        model = cls._from_config(config, attn_implementation=spec.attn, **mf.FLOAT32)
    else:
        model = AutoModelForCausalLM.from_config(config, attn_implementation=spec.attn, **mf.FLOAT32)
    model = model.float().eval()
    with tempfile.TemporaryDirectory() as tmp:
        mf.init_and_save(model, spec, Path(tmp) / "model")
    ref = load_file(str(folder / "reference.safetensors"))
    ids, mask = ref["input_ids"].long(), ref["attention_mask"].long()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    seen = torch.cumsum(mask, 1) > 0  # query rows that see a key (the others are implementation-defined)
    diff = (logits - ref["logits"])[seen].abs().max().item()
    if diff > 1e-5:
        raise RuntimeError(f"the rebuilt model does not reproduce the fixture's logits (max diff {diff:.3g})")
    return model, ids, mask


def padded_generate(model, ids, mask, rows_apart: bool = False, uncached: bool = False):
    """Cached greedy generate on the padded batch (eos off), the raw logits of each step, and pad invariance.
    ``rows_apart``: each row of the padded batch generated alone (pads and mask included), where transformers'
    batched generate is wrong for the model (Spec.generate_rows_apart); ``uncached``: use_cache=False, where its
    cached decode is wrong on padded rows (Spec.padded_generate_uncached)."""
    gen_cfg = transformers.GenerationConfig(
        max_new_tokens=mf.NEW_TOKENS, min_new_tokens=mf.NEW_TOKENS, do_sample=False, use_cache=not uncached,
        eos_token_id=None, pad_token_id=mf.PAD, bos_token_id=mf.BOS, num_beams=1, temperature=None, top_p=None,
        top_k=None)
    saved_eos, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    try:
        def run(prompt, prompt_mask):
            out = model.generate(input_ids=prompt, attention_mask=prompt_mask, generation_config=gen_cfg,
                                 output_logits=True, return_dict_in_generate=True)
            return out.sequences, torch.stack([step.float() for step in out.logits])  # [steps, batch, vocab]
        with torch.no_grad():
            if rows_apart:
                per_row = [run(ids[row:row + 1], mask[row:row + 1]) for row in range(ids.shape[0])]
                tokens, logits = torch.cat([t for t, _ in per_row]), torch.cat([lg for _, lg in per_row], 1)
            else:
                tokens, logits = run(ids, mask)
            invariant = True
            for row in range(ids.shape[0]):
                start = int((mask[row] == 0).sum())
                alone, alone_logits = run(ids[row:row + 1, start:], mask[row:row + 1, start:])
                invariant &= bool(torch.equal(alone[0], tokens[row, start:]))
                invariant &= (alone_logits[:, 0] - logits[:, row]).abs().max().item() <= PAD_INVARIANT_ATOL
    finally:
        model.generation_config.eos_token_id = saved_eos
    return tokens, logits, invariant


def pad_gradient(model, spec: mf.Spec, ids, mask):
    """Loss and the token embedding's pad-row gradient for the batch with the pad id as a real token in row 0."""
    ids = ids.clone()
    ids[0, PAD_AS_TOKEN_AT] = mf.PAD
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, mf.LEFT_PAD] = -100  # the row a query that sees no key would predict (make_fixtures.make_inputs)
    if not spec.loss_shifts_labels:
        labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    table = model.get_input_embeddings().weight
    return ids, labels, loss.detach().reshape(()), table.grad[mf.PAD].detach().clone()


def build(spec: mf.Spec, out_root: Path) -> dict:
    folder = out_root / spec.name
    if not (folder / "reference.safetensors").is_file():
        raise FileNotFoundError(f"{folder} has no fixture; run tools/make_fixtures.py first")
    model, ids, mask = rebuild(spec, folder)
    tokens, logits, invariant = padded_generate(model, ids, mask, rows_apart=bool(spec.generate_rows_apart),
                                                uncached=bool(spec.padded_generate_uncached))
    grad_ids, grad_labels, loss, pad_row = pad_gradient(model, spec, ids, mask)
    out = {
        "generate_tokens": tokens.to(torch.int32).contiguous(),
        "generate_logits": logits.contiguous(),
        "pad_grad_input_ids": grad_ids.to(torch.int32),
        "pad_grad_attention_mask": mask.to(torch.int32),
        "pad_grad_labels": grad_labels.to(torch.int32),
        "pad_grad_loss": loss.float(),
        "pad_grad_embedding_row": pad_row.float().contiguous(),
    }
    for k, v in out.items():
        if not torch.isfinite(v.float()).all():
            raise RuntimeError(f"non-finite values in {k}")
    save_file(out, str(folder / FILE), metadata={"transformers_version": transformers.__version__,
                                                  "torch_version": torch.__version__})
    embedding = model.get_input_embeddings()
    entry = {"padding_idx": embedding.padding_idx, "padded_generate_pad_invariant": invariant}
    if spec.generate_rows_apart:
        entry["padded_generate_rows_apart"] = spec.generate_rows_apart
    if spec.padded_generate_uncached:
        entry["padded_generate_uncached"] = spec.padded_generate_uncached
    return entry


def build_encoder(spec, out_root: Path) -> dict:
    """An encoder fixture (tests/fixtures/encoders): its batch with the pad id also a real token of row 0, the
    masked-LM loss and the word embedding's pad-row gradient (the batch keeps the fixture's labels and types)."""
    import make_encoder_fixtures  # the encoder fixtures' module, as main imports it for --encoders
    folder = out_root / spec.name
    cls = getattr(transformers, spec.model_class) if spec.model_class else transformers.AutoModelForMaskedLM
    model = cls.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).float().eval()
    ref = load_file(str(folder / "reference.safetensors"))
    ids, mask, labels = ref["input_ids"].long(), ref["attention_mask"].long(), ref["labels"].long()
    kwargs = {"token_type_ids": ref["token_type_ids"].long()} if "token_type_ids" in ref else {}
    with torch.no_grad():
        diff = (model(input_ids=ids, attention_mask=make_encoder_fixtures.model_mask(spec, mask), **kwargs).logits
                - ref["logits"])[mask.bool()].abs().max()
    if diff > 1e-5:
        raise RuntimeError(f"the reloaded model does not reproduce the fixture's logits (max diff {diff:.3g})")
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0  # make_inputs' padding id
    ids = ids.clone()
    ids[0, PAD_AS_TOKEN_AT] = pad
    logits = model(input_ids=ids, attention_mask=make_encoder_fixtures.model_mask(spec, mask), **kwargs).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=-100)  # what every one of them computes inside
    loss.backward()
    embedding = model.get_input_embeddings()
    save_file({"pad_grad_input_ids": ids.to(torch.int32), "pad_grad_loss": loss.detach().float().reshape(()),
               "pad_grad_embedding_row": embedding.weight.grad[pad].detach().float().contiguous()},
              str(folder / FILE), metadata={"transformers_version": transformers.__version__,
                                            "torch_version": torch.__version__,
                                            "padding_idx": str(embedding.padding_idx)})
    return {"padding_idx": embedding.padding_idx}


def main_kind(argv, kind, build_one, summary) -> int:
    """Build the padded references of another kind's fixtures (``kind``: its make_*_fixtures module)."""
    parsed = mf.parse_fixture_args(argv, kind.SPECS, kind.DEFAULT_OUT)
    if parsed is None:
        return 0
    args, out_root, only = parsed
    specs = [s for s in kind.SPECS if (out_root / s.name / "reference.safetensors").is_file()]
    _, failed = mf.build_each(specs, only, out_root, build_one, verbose=args.verbose, summary=summary)
    return 1 if failed else 0


def build_seq2seq(spec, out_root: Path) -> dict:
    """An encoder-decoder fixture (tests/fixtures/seq2seq): greedy generate from both rows of its batch at once (row 1
    right-padded by 2, with its attention_mask), eos off, as make_seq2seq_fixtures generates from row 0 alone."""
    import make_seq2seq_fixtures as ms
    folder = out_root / spec.name
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder, attn_implementation="eager",
                                                               dtype=torch.float32).float().eval()
    ms.apply_reference_fix(model, spec)
    ref = load_file(str(folder / "reference.safetensors"))
    ids, mask = ref["input_ids"].long(), ref["attention_mask"].long()
    gen_cfg = ms.clean_generation_config(model.config)
    saved_config, model.generation_config = model.generation_config, gen_cfg
    try:
        def run(prompt, prompt_mask):
            out = model.generate(input_ids=prompt, attention_mask=prompt_mask, generation_config=gen_cfg,
                                 output_logits=True, return_dict_in_generate=True)
            return out.sequences, torch.stack([step.float() for step in out.logits])  # [steps, batch, vocab]
        with torch.no_grad():
            tokens, logits = run(ids, mask)
            alone0 = run(ids[:1], mask[:1])[0]
            if not torch.equal(alone0[0], ref["greedy_tokens"][0].long()):
                raise RuntimeError("row 0 alone does not reproduce the fixture's greedy_tokens")
            invariant = True
            for row in range(ids.shape[0]):
                length = int(mask[row].sum())
                alone, alone_logits = run(ids[row:row + 1, :length], mask[row:row + 1, :length])
                invariant &= bool(torch.equal(alone[0], tokens[row]))
                invariant &= (alone_logits[:, 0] - logits[:, row]).abs().max().item() <= PAD_INVARIANT_ATOL
    finally:
        model.generation_config = saved_config
    if tokens.shape[1] != 1 + ms.NEW_TOKENS:
        raise RuntimeError(f"generate stopped early: {tokens.shape}")
    save_file({"generate_tokens": tokens.to(torch.int32).contiguous(), "generate_logits": logits.contiguous()},
              str(folder / FILE), metadata={"transformers_version": transformers.__version__,
                                            "torch_version": torch.__version__,
                                            "padded_generate_pad_invariant": str(invariant)})
    return {"padded_generate_pad_invariant": invariant}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--encoders" in argv:  # the encoder fixtures (tests/fixtures/encoders) instead
        argv.remove("--encoders")
        import make_encoder_fixtures
        return main_kind(argv, make_encoder_fixtures, build_encoder,
                         lambda info: f"padding_idx={info['padding_idx']}")
    if "--seq2seq" in argv:  # the encoder-decoder fixtures (tests/fixtures/seq2seq) instead
        argv.remove("--seq2seq")
        import make_seq2seq_fixtures
        return main_kind(argv, make_seq2seq_fixtures, build_seq2seq,
                         lambda info: f"pad_invariant={info['padded_generate_pad_invariant']}")
    parsed = mf.parse_fixture_args(argv, mf.SPECS, mf.DEFAULT_OUT)
    if parsed is None:
        return 0
    args, out_root, only = parsed
    major = int(transformers.__version__.split(".")[0])
    specs = [s for s in mf.SPECS if s.transformers_major == major and (out_root / s.name).is_dir()]
    built, failed = mf.build_each(specs, only, out_root, build, verbose=args.verbose,
                                  summary=lambda info: f"padding_idx={info['padding_idx']} "
                                                       f"pad_invariant={info['padded_generate_pad_invariant']}")
    index_path = out_root / "index.json"
    index = json.loads(index_path.read_text())
    for name, info in built.items():
        index["built"][name].update(info)
    for name, reason in failed.items():
        index["built"][name].pop("padding_idx", None)
        index["built"][name]["padded_generate_pad_invariant"] = f"not built: {reason}"
    index_path.write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
