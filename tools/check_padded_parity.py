"""Padded-batch parity of vkformers against transformers for configs of your own, outside the fixture suite.

Two steps, two interpreters: the reference step needs transformers and torch, the compare step vkformers.

    /tmp/tfvenv/bin/python tools/check_padded_parity.py reference --out /tmp/padded   # builds every case
    python tools/check_padded_parity.py compare --out /tmp/padded                      # vkformers against it
    ... --only NAME[,NAME]                                                            # just these cases

Each case is a fixture spec of tools/make_fixtures.py (by name) with config overrides on top, built and
initialised as the fixtures are, and run on a batch of BATCH rows of up to ``length`` tokens where every row
but the first is padded (left for decoders), labels -100 on pads and on the first real token after a left pad
(a query that sees no key predicts it). Compared: logits at real tokens, the loss, every gradient, and a greedy
``generate`` of the left-padded batch (its tokens and the first step's logits).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PAD_ID = 0
NEW_TOKENS = 8

# name -> (fixture spec of make_fixtures.py, config overrides, prompt length, pads per padded row)
CASES = {
    "hunyuan_ntk_alpha": ("hunyuan_v1_dense", dict(rope_parameters=dict(
        rope_type="dynamic", rope_theta=10000.0, factor=1.0, alpha=1000.0)), 12, (3,)),
    "deepseek_v4_padded": ("deepseek_v4", {}, 12, (5, 2)),
    "minimax_m3_padded": ("minimax_m3_vl_text", {}, 14, (5, 3)),
    "trocr_padded": ("trocr", {}, 10, (3,)),
    "trocr_sinusoidal_padded": ("trocr_sinusoidal", {}, 10, (3,)),
    "glm5_next_wide_v": ("glm5_next_text", dict(v_head_dim=16), 10, (3,)),
    "biogpt_eps": ("biogpt", dict(layer_norm_eps=1.0), 10, (3,)),
    "glm5_next_padded": ("glm5_next_text", {}, 12, (5, 2)),
    "glm_moe_dsa_padded": ("glm_moe_dsa", {}, 12, (5, 2)),
    "deepseek_v32_padded": ("deepseek_v32", {}, 12, (5, 2)),
    "axk2_padded": ("axk2", {}, 12, (5, 2)),
    "llama_padded": ("llama", {}, 12, (5, 2)),
    "opt_padded": ("opt", {}, 12, (5, 2)),
    "gemma2_padded": ("gemma2", {}, 12, (5, 2)),
    "bloom_padded": ("bloom", {}, 12, (5, 2)),
    "xglm_padded": ("xglm", {}, 12, (5, 2)),
    "qwen3_next_padded": ("qwen3_next", {}, 12, (5, 2)),
}


def make_batch(length: int, pads, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    rows = 1 + len(pads)
    ids = rng.integers(3, vocab, size=(rows, length)).astype(np.int64)
    mask = np.ones_like(ids)
    labels = ids.copy()
    for r, p in enumerate(pads, start=1):
        ids[r, :p], mask[r, :p], labels[r, :p + 1] = PAD_ID, 0, -100
    return ids, mask, labels


def reference(names, out_root: Path):
    import torch
    from safetensors.torch import save_file
    sys.path.insert(0, str(ROOT / "tools"))
    import make_fixtures as mf
    torch.set_num_threads(1)
    specs = {s.name: s for s in mf.SPECS}
    for name in names:
        base, overrides, length, pads = CASES[name]
        spec = specs[base]
        torch.manual_seed(0)
        config = mf.CONFIG_MAPPING[spec.model_type](**{**spec.overrides, **overrides})
        if spec.model_class:
            cls = getattr(mf.transformers, spec.model_class, None) or mf.LOCAL_MODEL_CLASSES[spec.model_class]()
            model = cls._from_config(config, attn_implementation=spec.attn, **mf.FLOAT32)
        else:
            model = mf.AutoModelForCausalLM.from_config(config, attn_implementation=spec.attn, **mf.FLOAT32)
        model = model.float().eval()
        folder = mf.init_and_save(model, spec, out_root / name)
        ids, mask, labels = (torch.from_numpy(a) for a in make_batch(length, pads, config.vocab_size))
        if not spec.loss_shifts_labels:
            labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        ref = {"input_ids": ids.int(), "attention_mask": mask.int(), "labels": labels.int(),
               "logits": out.logits.detach().float().contiguous(), "loss": out.loss.detach().reshape(())}
        for n, p in model.named_parameters():
            ref[f"grad.{n}"] = (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().contiguous()
        if spec.saved_names:
            ref = mf._with_saved_names(model, ref)
        with torch.no_grad():
            gen_cfg = mf.GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                          use_cache=True, eos_token_id=None, pad_token_id=PAD_ID, num_beams=1,
                                          temperature=None, top_p=None, top_k=None)
            model.generation_config.eos_token_id = None
            gen = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg, output_logits=True,
                                 return_dict_in_generate=True)
        ref["generated"] = gen.sequences.int().contiguous()
        ref["generate_logits"] = torch.stack([step.float() for step in gen.logits], 1).contiguous()  # [B, new, V]
        save_file(ref, str(folder / "padded_reference.safetensors"))
        print(f"reference {name}: loss {out.loss.item():.5f}, generated {gen.sequences[:, length:].tolist()}")


def compare(names, out_root: Path) -> int:
    from vkformers.models.loading import AutoModelForCausalLM
    from vkformers.models.safetensors_io import read_safetensors
    failures = 0
    for name in names:
        folder = out_root / name
        ref = {k: e.as_float() for k, e in read_safetensors(folder / "padded_reference.safetensors").items()}
        ids, mask, labels = (ref[k].astype(np.int32) for k in ("input_ids", "attention_mask", "labels"))
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32")
            out = model(ids, attention_mask=mask, labels=labels)
        except Exception as exc:  # noqa: BLE001 - a refused config is a finding, reported as such
            print(f"FAIL {name}: {type(exc).__name__}: {exc}")
            failures += 1
            continue
        logits = out.logits.numpy()
        real = mask.astype(bool)
        logit_err = float(np.abs(logits - ref["logits"])[real].max())
        loss_err = abs(out.loss.item() - float(ref["loss"])) / abs(float(ref["loss"]))
        out.loss.backward()
        params = dict(model.named_parameters())
        grads = {k[5:]: v for k, v in ref.items() if k.startswith("grad.")}
        largest = max(float(np.abs(g).max()) for g in grads.values())
        grad_bad = []
        for n, expected in grads.items():
            got = params[n].grad.numpy() if n in params and params[n].grad is not None else np.zeros_like(expected)
            err = float(np.abs(got - expected).max())
            if err > 1e-3 * max(float(np.abs(expected).max()), 1e-3 * largest):
                grad_bad.append(f"{n} {err:.3g}")
        # the last position's logits of every forward generate runs (a replayed, captured step runs none)
        steps, forward = [], model.forward
        model.forward = lambda *a, **k: steps.append(forward(*a, **k)) or steps[-1]
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=[],
                                   pad_token_id=PAD_ID)
        del model.forward
        gen_ok = np.array_equal(np.asarray(generated), ref["generated"].astype(np.int64))
        if len(steps) != NEW_TOKENS:  # replayed (captured) steps run no forward: once more without captures
            steps, model.capture_decode = [], False
            model.forward = lambda *a, **k: steps.append(forward(*a, **k)) or steps[-1]
            model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=[], pad_token_id=PAD_ID)
            del model.forward
        step_logits = [out.logits.numpy()[:, -1] for out in steps]
        step_err = max(float(np.abs(got - ref["generate_logits"][:, k]).max()) for k, got in enumerate(step_logits))
        ok = logit_err <= 1e-4 and loss_err <= 1e-5 and not grad_bad and gen_ok and step_err <= 1e-4
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: logits {logit_err:.3g}, loss rel {loss_err:.3g}, "
              f"grads {'ok' if not grad_bad else grad_bad[:4]}, generate {'same' if gen_ok else 'DIFFERS'} "
              f"({len(step_logits)} steps' logits {step_err:.3g})")
        if step_err > 1e-4:
            errors = [[float(np.abs(got[r] - ref["generate_logits"][r, k]).max()) for k, got in enumerate(step_logits)]
                      for r in range(ids.shape[0])]
            print("     step logits error [row, step]:", np.round(errors, 4).tolist())
        if not gen_ok:
            length = ids.shape[1]
            print(f"     ours   {np.asarray(generated)[:, length:].tolist()}\n"
                  f"     theirs {ref['generated'][:, length:].astype(int).tolist()}")
    return 1 if failures else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("step", choices=("reference", "compare"))
    ap.add_argument("--out", default="/tmp/padded_parity")
    ap.add_argument("--only", default="")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(CASES)
    unknown = set(names) - set(CASES)
    if unknown:
        ap.error(f"unknown case(s): {sorted(unknown)}; known: {', '.join(CASES)}")
    out_root = Path(args.out)
    out_root.mkdir(parents=True, exist_ok=True)
    if args.step == "reference":
        reference(names, out_root)
        return 0
    return compare(names, out_root)


if __name__ == "__main__":
    sys.exit(main())
