"""Write tests/fixtures/wrappers/<spelling>/: tiny random multimodal wrapper checkpoints and their text-only outputs.

A wrapper spelling (LLaVA, Gemma 3, Qwen2-VL, Voxtral, ...) nests its language model's config (text_config) beside
vision or audio towers; vkformers loads it as that language model. Each fixture is the wrapper class transformers
itself saves (*ForConditionalGeneration), its language model sized like tools/make_fixtures.py's fixture of the same
model_type (that fixture's overrides, else the plain Llama-style sizes), its towers as small as their configs allow,
re-initialised by make_fixtures' reinit_, saved with save_pretrained (config.json + model.safetensors, towers
included: that is the file users load), and transformers' outputs for input_ids only (no pixels or audio): logits of
make_fixtures' [2, 8] batch (row 1 left-padded) and a 12-token greedy generate with the KV cache (eos off).
tests/test_wrapper_parity.py loads each folder with vkformers' AutoModelForCausalLM and compares. Afterwards
tools/slim_wrapper_fixtures.py (vkformers' environment) turns the towers' tensors into one-element stand-ins: the
names stay, the bytes go.

    python tools/make_wrapper_fixtures.py                    # every wrapper, into tests/fixtures/wrappers
    python tools/make_wrapper_fixtures.py --only llava,gemma3
    python tools/make_wrapper_fixtures.py --list

Deterministic: one CPU thread, fixed seeds, sorted JSON (meta.json records the versions). index.json lists the
spellings built, those transformers cannot build or run text-only and those not attempted, and why.
"""
from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import transformers  # noqa: E402
from make_fixtures import (FLOAT32, L, NEW_TOKENS, SPECS, build_each,  # noqa: E402
                           greedy_reference, init_and_save, make_inputs, parse_fixture_args, publish)
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers.models.auto import modeling_auto  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "wrappers"

# Towers (vision, audio, perceiver, ...): the smallest sizes their configs take. Applied to every field of that name
# in every nested config other than the text one; a field a config lacks is skipped.
TOWER = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
             embed_dim=16, depth=1, num_heads=2, d_model=16, encoder_layers=1, encoder_attention_heads=2,
             encoder_ffn_dim=16, projection_dim=32, out_hidden_size=32, vision_output_dim=32,
             num_global_layers=1, resampler_n_latents=4, resampler_depth=1, resampler_n_heads=2,
             resampler_head_dim=8, head_dim=8, mlp_dim=16, output_channels=16, num_filters=4, base_channels=8,
             latent_channels=8, num_embeddings=16, image_token_embed_dim=16, hidden_dim=16, dim_head=8, max_pos_emb=16,
             projection_intermediate_size=16, downsample_hidden_size=8, output_dim=32, vocab_size=16,
             encoder_hidden_size=16, num_res_blocks=1, projector_hidden_size=16, patch_size=2,
             num_position_embeddings=16, max_source_positions=16, max_vit_seq_len=16)


@dataclass
class Spec:
    name: str                      # the wrapper spelling (config.json model_type) and fixture folder
    text: dict = field(default_factory=dict)   # text_config overrides over its base (text_spec)
    root: dict = field(default_factory=dict)   # root config overrides
    tower: dict = field(default_factory=dict)  # {sub-config name: overrides} after TOWER
    notes: list = field(default_factory=list)

    @property
    def model_type(self):  # parse_fixture_args' --list
        return self.name


def mrope(*sections):
    """rope_parameters with mRoPE sections (they must sum to the rotary dims / 2)."""
    return dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=list(sections)))


SPELLINGS = [
    "mllama", "llama4", "emu3", "aria", "fuyu", "mistral3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe",
    "qwen3_omni_moe_thinker", "qwen3_omni_moe", "qwen3_5", "qwen3_5_moe", "qwen4_exp", "glm4v", "glm4v_moe", "glm46v",
    "glm_ocr", "glm5_next", "kimi_k25", "hunyuan_vl", "gemma3", "exaone4_5", "cohere_compass", "cohere2_vision",
    "cosmos3_omni", "got_ocr2", "aya_vision", "llava", "llava_next", "llava_next_video", "llava_onevision",
    "video_llava", "video_llama_3", "vipllava", "idefics2", "idefics3", "smolvlm", "qwen2_audio", "voxtral",
    "internvl", "janus", "ovis2", "paligemma", "deepseek_vl", "deepseek_vl_hybrid", "paddleocr_vl", "audioflamingo3",
    "qwen3_asr", "granite_speech", "granite_speech_plus", "granite4_vision", "glmasr", "musicflamingo",
    "vibevoice_asr", "minimax_m3_vl",
]
NOT_ATTEMPTED = {  # wrapper spellings of the reference table left out, and why
    "fast_vlm": "its vision tower is a TimmWrapperModel: needs timm, not a dependency here",
    "modernvbert": "an encoder (masked LM over ModernBERT), no causal LM",
    "kimi_k3": "not in transformers 5.24",
}
OVERRIDES = [
    Spec("qwen2_vl", text=mrope(1, 1, 2)),
    Spec("qwen2_5_vl", text=mrope(1, 1, 2)),
    Spec("glm4v", text=mrope(2, 1, 1)),
    Spec("glm46v", text=mrope(2, 1, 1)),
    Spec("glm_ocr", text=mrope(2, 1, 1)),
    Spec("glm4v_moe", text=dict(use_qk_norm=False, **mrope(1, 1, 0)),
         notes=["transformers' GLM-4.5V text attention has no q/k norms whatever use_qk_norm says"]),
    Spec("qwen3_vl_moe", text=dict(moe_intermediate_size=12)),  # 2I != hidden: the fused experts' layout shows
    Spec("mllama", text=dict(num_hidden_layers=3, cross_attention_layers=[1])),  # a cross-attention layer, which
    #                                                                        text-only runs skip, between two others
    Spec("emu3", root=dict(vocabulary_map={}), tower=dict(vq_config=dict(
        base_channels=32, latent_channels=32, channel_multiplier=[1, 1], codebook_size=16))),  # GroupNorm(32)
    Spec("vibevoice_asr", tower={f"{kind}_tokenizer_encoder_config": dict(num_filters=1, depths=[1] * 7, ffn_expansion=1)
                                 for kind in ("acoustic", "semantic")}),
    Spec("granite_speech", tower=dict(encoder_config=dict(context_size=8))),
    Spec("granite_speech_plus", tower=dict(encoder_config=dict(context_size=8))),
    Spec("qwen3_omni_moe", root=dict(talker_config=dict(text_config=dict(shared_expert_intermediate_size=16)))),
    Spec("hunyuan_vl", text=dict(head_dim=8, **mrope(1, 1, 2)), tower=dict(vision_config=dict(max_image_size=8))),
    Spec("janus", tower=dict(vq_config=dict(base_channels=32, latent_channels=32, channel_multiplier=[1, 1]))),
    Spec("paligemma", root=dict(projection_dim=32)),
    Spec("fuyu", root=dict(patch_size=2)),
    Spec("idefics2", tower=dict(perceiver_config=dict(hidden_size=32))),
    Spec("ovis2", root=dict(hidden_size=32)),
    Spec("cohere2_vision", root=dict(alignment_intermediate_size=16)),
    Spec("minimax_m3_vl", root=dict(projector_hidden_size=16, merged_hidden_size=64)),
    Spec("qwen3_omni_moe_thinker", root=dict(vision_start_token_id=151652)),
    Spec("granite4_vision", root=dict(deepstack_layer_map=[[-1, 1]], downsample_rate="1/2",
                                      spatial_target_layers=[0, 1, 0, 1]),
         tower=dict(vision_config=dict(hidden_size=64))),  # its Q-Former gets hidden_size // 64 heads
]
SPECS_W = [next((o for o in OVERRIDES if o.name == s), Spec(s)) for s in SPELLINGS]
# A text model_type without a make_fixtures spec takes the spec of the model it is a variant of.
TEXT_BASE = {"qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3",
             "qwen3_vl_moe_text": "qwen3_moe", "qwen3_omni_moe_text": "qwen3_moe", "glm4v_text": "glm4",
             "glm_ocr_text": "glm4", "glm4v_moe_text": "glm4_moe", "hunyuan_vl_text": "hunyuan_v1_dense",
             "granite4_vision_text": "granite", "mllama_text_model": "llama", "paddleocr_vl_text": "llama"}
# model classes tried in this order (the first auto mapping that has the spelling)
MAPPINGS = ("MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
            "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")


def text_spec(model_type):
    """make_fixtures' first spec of this text model_type (its sizes and options), or None."""
    model_type = TEXT_BASE.get(model_type, model_type)
    return next((s for s in SPECS if s.model_type == model_type and s.transformers_major == 5), None)


def shrink(config, text):
    """Every nested config except ``text`` gets TOWER's sizes where it has the field."""
    for key, sub in list(vars(config).items()):
        if not isinstance(sub, transformers.PretrainedConfig) or sub is text:
            continue
        for name, value in TOWER.items():
            if hasattr(sub, name) and isinstance(getattr(sub, name), int) and not isinstance(getattr(sub, name), bool):
                setattr(sub, name, value)
        if isinstance(getattr(sub, "image_size", None), int) and isinstance(getattr(sub, "patch_size", None), int):
            sub.image_size = 2 * sub.patch_size  # position tables: 2 x 2 patches
        if isinstance(getattr(sub, "depths", None), list):
            sub.depths = [1] * len(sub.depths)
        shrink(sub, text)


def make_config(spec: Spec):
    if spec.name not in CONFIG_MAPPING:
        raise LookupError(f"transformers {transformers.__version__} has no config for {spec.name!r}")
    cls = CONFIG_MAPPING[spec.name]
    default = cls()
    holder = default.thinker_config if hasattr(default, "thinker_config") else default
    text_type = holder.text_config.model_type
    base = text_spec(text_type)
    text = {**(base.overrides if base else L), **spec.text}
    if hasattr(default, "thinker_config"):
        config = cls(thinker_config=dict(text_config=dict(text, model_type=text_type)), **spec.root)
        text_config = config.thinker_config.text_config
    else:
        config = cls(text_config=dict(text, model_type=text_type), **spec.root)
        text_config = config.text_config
    shrink(config, text_config)
    for key, overrides in spec.tower.items():
        for name, value in overrides.items():
            setattr(getattr(config, key), name, value)
    # a round trip through config.json re-derives what the config class sets from other fields, so the saved folder
    # reloads (transformers' from_pretrained) into the same shapes
    return cls.from_dict(config.to_dict()), text_type, base


def model_class(spelling):
    for mapping in MAPPINGS:
        names = getattr(modeling_auto, mapping)
        if spelling in names:
            return getattr(transformers, names[spelling])
    raise LookupError(f"no generative model class for {spelling!r} in transformers {transformers.__version__}")


def build(spec: Spec, out_root: Path):
    out = out_root / spec.name
    if out.exists():
        shutil.rmtree(out)
    torch.manual_seed(0)
    config, text_type, base = make_config(spec)
    cls = model_class(spec.name)
    model = cls._from_config(config, attn_implementation="eager", **FLOAT32).float().eval()
    tmp = init_and_save(model, base, out_root / (spec.name + ".tmp"))

    ids, mask, _ = make_inputs()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        prompt = ids[:1]
        tokens, glogits = greedy_reference(model, prompt)
        prefill_diff = (glogits[0] - logits[0, -1]).abs().max().item()
        # what transformers' own loader makes of the saved folder
        reloaded = cls.from_pretrained(tmp, attn_implementation="eager", **FLOAT32).eval()
        reload_diff = (reloaded(input_ids=ids, attention_mask=mask).logits - logits)[mask.bool()].abs().max().item()
    ref = {"input_ids": ids.to(torch.int32), "attention_mask": mask.to(torch.int32), "logits": logits.contiguous(),
           "greedy_tokens": tokens.to(torch.int32), "greedy_logits": glogits.contiguous()}
    for k, v in ref.items():
        if not torch.isfinite(v.float()).all():
            raise RuntimeError(f"non-finite values in {k}")
    save_file(ref, str(tmp / "reference.safetensors"))
    saved = sorted(load_file(str(tmp / "model.safetensors")).keys())
    text_prefixes = ("model.language_model.", "language_model.", "lm_head.")
    meta = {
        "fixture": spec.name,
        "model_type": spec.name,
        "model_class": type(model).__name__,
        "text_model_type": text_type,
        "text_config_from": (f"make_fixtures spec {base.name!r}" if base else "make_fixtures.L")
                            + (f" + {spec.text}" if spec.text else ""),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "attn_implementation": "eager",
        "notes": spec.notes,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "saved_key_prefixes": sorted({".".join(k.split(".")[:2]) for k in saved}),
        "saved_keys_outside_text_prefixes": len([k for k in saved if not k.startswith(text_prefixes)]),
        "generation": {"prompt": "input_ids[0] (unpadded)", "max_new_tokens": NEW_TOKENS, "do_sample": False,
                       "use_cache": True, "eos_token_id": None},
        "checks": {
            "logits_std": round(logits[mask.bool()].std().item(), 4),
            "greedy_first_step_vs_batch_logits_max_abs_diff": float(f"{prefill_diff:.3g}"),
            "from_pretrained_reload_logits_max_abs_diff": float(f"{reload_diff:.3g}"),
        },
    }
    return publish(tmp, out, meta)


def main(argv=None):
    parsed = parse_fixture_args(argv, SPECS_W, DEFAULT_OUT, name_width=24)
    if parsed is None:
        return 0
    args, out_root, only = parsed
    index_path = out_root / "index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() and only else {}
    built, failed = index.get("built", {}), index.get("failed", {})
    for name in only:
        built.pop(name, None)
        failed.pop(name, None)
    new, new_failed = build_each(
        SPECS_W, only, out_root, build, verbose=args.verbose,
        summary=lambda m: (f"{m['model_class']} text={m['text_model_type']} std={m['checks']['logits_std']} "
                           f"reload={m['checks']['from_pretrained_reload_logits_max_abs_diff']}"))
    for name, meta in new.items():
        built[name] = {"model_class": meta["model_class"], "text_model_type": meta["text_model_type"]}
    failed.update(new_failed)
    index = {"transformers_version": transformers.__version__, "torch_version": torch.__version__,
             "built": dict(sorted(built.items())), "failed": dict(sorted(failed.items())),
             "not_attempted": dict(sorted(NOT_ATTEMPTED.items()))}
    index_path.write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
