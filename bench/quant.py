"""Quantized weights: a Llama model whose Linear weights stay in packed blocks, against the same model in bfloat16.

For each weight format (bfloat16, then each block format given), with the same shape in the same process:
- greedy decode at batch 1 (new tokens/s), and the share of the memory-bandwidth bound it reaches (the bytes of
  every weight a token reads, over --bandwidth-gbs);
- a 512-token prefill at batch 1 (tokens/s);
- the device memory the model's buffers take (the runtime's buffer accounting).
Embeddings, norms and the LM head stay bfloat16 in every format, as from_pretrained(quantization=...) leaves them,
but in q4_k_m: llama.cpp's Q4_K_M layout, Q4_K with attn_v, ffn_down and the LM head in Q6_K (as a downloaded
Q4_K_M GGUF holds them).

Random weights are drawn for a few rows and tiled over each matrix (packed once, then repeated block rows), so the
host neither draws nor quantizes billions of values: the timings do not depend on the values.

    python bench/quant.py [--formats q4_k,q8_0] [--layers 32] [--new-tokens 64] [--json OUT]

--sweep: instead, the fused decode products alone (decode_matvec's q_* variants) at batch 1 on the 8B shapes
(4096 -> 6144 q/k/v with rotary and cache write, 4096 -> 4096 o_proj, 4096 -> 2 x 14336 gate/up, 14336 -> 4096
down), --layers distinct copies so that no weight stays in cache, timed with GPU timestamps beside the bfloat16
products in their default shape: for each format of --formats (q4_k,q6_k,q5_k,q8_0,q4_0 by default), the shapes
engine/kernels/decode.py's QUANT_LAUNCH picks now ("the table"), then every launch shape of QUANT_SWEEP_SHAPES
(subgroups of 32 lanes per workgroup, units of 32 weights in flight per lane, pairs of columns computed together,
split k) for the first format and of QUANT_SWEEP_SHORT for the others (--full: all of them for every format). It
prints each shape's GB/s and share of --bandwidth-gbs per product and over the layer with its speed against
bfloat16's layer, then per format the fastest shape over the layer and per product, and the QUANT_LAUNCH lines that
make them the defaults (a whole QUANT_LAUNCH at the end). Each shape is timed after --warm-up seconds of untimed
replays (1.0): most of a shape's wall time is the host creating its pipelines, and a GPU idle that long lowers its
clocks (common.WARM_UP_SECONDS); bfloat16's layer is timed again at the end, and a drift of more than 5% from the
first is reported. No shape is started after --budget seconds (300; the first format may take 55% of them, each other
an equal share of the rest): the run stays under 7 minutes on the H200.

    python bench/quant.py --sweep [--formats q4_k,q6_k] [--layers 8] [--full] [--budget 300] [--warm-up 1.0]
                          [--json OUT]

--qlora: instead, LoRA training steps (r 16, alpha 32, on all seven projections; AdamW, bf16 compute, gradient
checkpointing) at --batch x --seq (4 x 512) on the 8B shape (--layers of them): the NF4 base (QLoRA) against the
bfloat16 base in the same run, and PyTorch + PEFT LoRA on a bfloat16 base with gradient checkpointing when PyTorch
sees a CUDA device (and peft is installed). Tokens/s, and peak device memory from the runtime's buffer accounting
(torch.cuda.max_memory_allocated for PyTorch), both from before the model is built. --qlora-70b: one QLoRA step of
the 70B shape (hidden 8192, 80 layers, 64/8 heads, ffn 28672) at 1 x 1024 instead (--layers for a short run): the
time of its second step (the first records it) and the peak memory of both (goal: under 48 GiB on one H200).

--formats bf16 or nf4 runs one base only, --no-peft leaves PyTorch out, --memory prints where each peak goes (base
weights, adapters, optimizer state, and the step's plan by lazy.memory_report(): intermediate values, results,
scratch, and the values alive at its peak by the op that made them), --planner exact measures the old memory
planner, --dry-run records each step's plan without running it (memory only: any device, in seconds).

    python bench/quant.py --qlora [--layers 32] [--batch 4] [--seq 512] [--steps 5] [--formats nf4] [--memory]
                          [--no-peft] [--planner exact] [--dry-run] [--json OUT]
    python bench/quant.py --qlora-70b [--layers 80] [--memory] [--dry-run] [--json OUT]
"""
from __future__ import annotations

import argparse
import gc
import sys
import time

import numpy as np

from common import LLAMA3_8B, WARM_UP_SECONDS, warm_up, write_results
from llama import timed

import vkformers as vkf
from vkformers.engine import lazy
from vkformers.engine.kernels import decode as KD
from vkformers.engine.quantized import QuantizedArray, quant_format, quantize
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.models.quantize import quantizable_weights
from vkformers.runtime import vulkan
from vkformers.training import LoraConfig, Trainer, TrainingConfig, apply_lora

LLAMA_70B = dict(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8)
QLORA = dict(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj"])
SAMPLE_ROWS = 64  # rows drawn per matrix, then tiled
REPEATS = 5


def packed_format(name: str, fmt: str | None, packed_names) -> str | None:
    """The block format weight ``name`` is packed in (None: bfloat16); ``fmt`` q4_k_m: llama.cpp's Q4_K_M layout."""
    if fmt == "q4_k_m":
        if name == "lm_head.weight" or name.endswith(("v_proj.weight", "down_proj.weight")):
            return "q6_k"
        return "q4_k" if name in packed_names else None
    return fmt if name in packed_names else None


def sample_blocks(sample: np.ndarray, fmt: str, rng) -> np.ndarray:
    """``sample`` rows packed in ``fmt``; Q6_K (no quantizer here): random codes and scales, with d giving weights
    of about the sample's spread."""
    if fmt != "q6_k":
        return quantize(sample, quant_format(fmt))
    raw = rng.integers(0, 256, (sample.shape[0], sample.shape[1] // 256, 210), dtype=np.uint8)
    raw[..., 208:210] = np.full(raw.shape[:2], 1.7e-5, np.float16)[..., None].view(np.uint8)
    return raw.reshape(sample.shape[0], -1)


def tiled_weights(model, fmt: str | None, seed=0) -> dict:
    """Every slot's weights from SAMPLE_ROWS random rows repeated; Linear weights packed in ``fmt`` (None: float).
    Slots of one shape and format share one host array (every layer the same values), so that the host holds one
    layer's worth (a 70B shape's packed layers would take ~40 GB)."""
    rng = np.random.default_rng(seed)
    packed_names = set(quantizable_weights(model)) if fmt else set()
    weights, made = {}, {}
    for name, slot in model.named_slots():
        if slot.tied_to is not None:
            continue
        shape = tuple(slot.shape)
        if name.endswith("norm.weight") or "layernorm" in name:
            weights[name] = np.ones(shape, np.float32)
            continue
        packed = packed_format(name, fmt, packed_names)
        if (shape, packed) in made:
            weights[name] = made[shape, packed]
            continue
        rows = min(SAMPLE_ROWS, shape[0])
        sample = rng.standard_normal((rows, *shape[1:]), dtype=np.float32) * 0.02
        repeat = -(-shape[0] // rows)
        if packed:
            block_rows = sample_blocks(sample, packed, rng)
            weights[name] = QuantizedArray(np.tile(block_rows, (repeat, 1))[:shape[0]], packed, shape)
        else:
            weights[name] = np.tile(sample, (repeat,) + (1,) * (len(shape) - 1))[:shape[0]]
        made[shape, packed] = weights[name]
    return weights


def weight_bytes_per_token(model, fmt: str | None) -> int:
    """Bytes of every weight a decode step reads: the packed Linear weights, the rest bfloat16 (the embedding
    table reads one row)."""
    packed_names = set(quantizable_weights(model)) if fmt else set()
    total = 0
    for name, slot in model.named_slots():
        if slot.tied_to is not None:
            continue
        shape = tuple(slot.shape)
        packed = packed_format(name, fmt, packed_names)
        if "embed_tokens" in name:
            total += shape[-1] * 2
        elif packed:
            total += shape[0] * quant_format(packed).row_bytes(shape[1])
        else:
            total += int(np.prod(shape)) * 2
    return total


def bench_format(config, fmt: str | None, prompt, new_tokens, bandwidth_gbs: float) -> dict:
    before = vulkan.buffer_memory()["live_bytes"]
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(tiled_weights(model, fmt), dtype="bfloat16", requires_grad=False)
    model.eval()
    out = {"weights_gib": (vulkan.buffer_memory()["live_bytes"] - before) / 2**30}
    with vkf.no_grad():
        first = np.ascontiguousarray(prompt[:1])
        warm_up(lambda: model(first).logits[:, -1].numpy(), 2.0)
        out["prefill_tok_s"] = prompt.shape[1] / timed(lambda: model(first).logits[:, -1].numpy(), REPEATS)
        ids = np.ascontiguousarray(prompt[:1, :16])
        generate = lambda: model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=[])
        warm_up(generate, 2.0)
        out["decode_b1_tok_s"] = new_tokens / timed(generate, REPEATS)
    bound = bandwidth_gbs * 1e9 / weight_bytes_per_token(model, fmt)
    out["decode_b1_bound_tok_s"] = bound
    out["decode_b1_of_bound"] = out["decode_b1_tok_s"] / bound
    model.forget_captures()  # its plans go with it when the function returns
    return out


def decode_products(hidden: int, ffn: int, heads: int, kv_heads: int, head_dim: int = 128) -> tuple:
    """A Llama layer's decode products: (name, mode, k, widths)."""
    return (("qkv + norm + rotary", "qkv", hidden, (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)),
            ("o_proj + residual", "plain", heads * head_dim, (hidden,)),
            ("gate/up + norm + act", "gated", hidden, (ffn, ffn)),
            ("down + residual", "plain", ffn, (hidden,)))


# The 8B decode products (--quick: a small layer, for a CPU device).
SWEEP_PRODUCTS = decode_products(4096, 14336, 32, 8)
SWEEP_HEAD_DIM, SWEEP_CAPACITY = 128, 64
SWEEP_FORMATS = "q4_k,q6_k,q5_k,q8_0,q4_0"


def sweep_kinds() -> list[str]:
    """QUANT_LAUNCH's kind of each sweep product (decode.product_kind)."""
    return [KD.product_kind(mode, k, widths) for _, mode, k, widths in SWEEP_PRODUCTS]


def in_subgroups(device, shape):
    """A shape counted in 32-lane subgroups as decode_matvec's launch (this device's subgroups)."""
    return (max(1, shape[0] * 32 // device.limits["subgroup_size"]),) + tuple(shape[1:])


def sweep_weights(device, fmt: str | None, layers: int) -> list:
    """Each layer's weights of the four products (packed in ``fmt``, or bfloat16); their contents do not matter."""
    f = quant_format(fmt) if fmt else None
    weight = lambda n, k: (device.buffer(n * f.row_bytes(k), "uint8", name="w") if f  # noqa: E731
                           else device.buffer(n * k, "bfloat16", name="w"))
    return [[[weight(n, k) for n in widths] for _, _, k, widths in SWEEP_PRODUCTS] for _ in range(layers)]


def record_products(device, fmt: str | None, weights: list, launch, rows: int = 1):
    """The four decode products of every layer of ``weights`` (sweep_weights) at ``rows`` rows as one timestamped
    sequence; ``launch`` None: each product in its own default shape (QUANT_LAUNCH's, by kind, at one row)."""
    dtype = "bfloat16"
    buf = lambda n, name, d=dtype: device.buffer(n, d, name=name)  # noqa: E731 (contents do not matter for timing)
    (_, _, hidden, qkv), (_, _, _, o), (_, _, _, gate_up), (_, _, ffn, down) = SWEEP_PRODUCTS
    x, h, q, act = buf(rows * hidden, "x"), buf(rows * hidden, "h"), buf(rows * qkv[0], "q"), buf(rows * ffn, "act")
    kv_heads = qkv[1] // SWEEP_HEAD_DIM
    caches = [buf(rows * kv_heads * SWEEP_CAPACITY * SWEEP_HEAD_DIM, name) for name in ("k_cache", "v_cache")]
    positions, start = device.upload(np.zeros(rows, np.int32)), device.upload(np.zeros(1, np.uint32))
    inv_freq = device.upload(np.ones(SWEEP_HEAD_DIM // 2, np.float32))
    norm = buf(ffn, "norm")
    seq = device.sequence(timestamps=True)
    common = dict(rows=rows, launch=launch, quant_format=quant_format(fmt) if fmt else None)
    for ws in weights:
        KD.decode_matvec(seq, x, ws[0], q, k=hidden, widths=qkv, mode="qkv", norm_weight=norm,
                         norm=True, out1=caches[0], out2=caches[1], positions=positions, cache_start=start,
                         inv_freq=inv_freq, head_dim=SWEEP_HEAD_DIM, rot_dim=SWEEP_HEAD_DIM, kv_heads=kv_heads,
                         capacity=SWEEP_CAPACITY, **common)
        KD.decode_matvec(seq, q, ws[1], h, k=qkv[0], widths=o, residual=x, **common)
        KD.decode_matvec(seq, h, ws[2], act, k=hidden, widths=gate_up, mode="gated", norm_weight=norm, norm=True,
                         **common)
        KD.decode_matvec(seq, act, ws[3], x, k=ffn, widths=down, residual=h, **common)
    return seq


def product_bytes(fmt: str | None) -> list[int]:
    size = (lambda n, k: n * quant_format(fmt).row_bytes(k)) if fmt else (lambda n, k: n * k * 2)
    return [sum(size(n, k) for n in widths) for _, _, k, widths in SWEEP_PRODUCTS]


def time_products(seq, repeats: int, warm_up_seconds: float = WARM_UP_SECONDS) -> list[float]:
    """Median GPU seconds of each product kind (median over the layers, then over the replays), after
    ``warm_up_seconds`` of untimed replays (at least one): the GPU at its working clocks, not the idle ones it falls
    to while the host creates the shape's pipelines."""
    seq.replay()
    warm_up(seq.replay, warm_up_seconds)
    runs = []
    for _ in range(repeats):
        seq.replay()
        runs.append([t for label, t in seq.timings()[1:] if label != "barrier"])
    per_op = np.median(np.array(runs), axis=0).reshape(-1, len(SWEEP_PRODUCTS))
    return [float(t) for t in np.median(per_op, axis=0)]


def launch_table(fmt: str, default, per_kind: dict) -> str:
    """QUANT_LAUNCH's lines for ``fmt``: its default shape, then the kinds that take another."""
    lines = [f"    {fmt!r}: {tuple(default)},"]
    lines += [f"    ({fmt!r}, {kind!r}): {tuple(shape)}," for kind, shape in per_kind.items()]
    return "\n".join(lines)


def sweep(formats, layers: int, repeats: int, bandwidth_gbs: float, budget: float, full: bool,
          warm_up_seconds: float = WARM_UP_SECONDS) -> dict:
    """Time QUANT_SWEEP_SHAPES (the first format; QUANT_SWEEP_SHORT for the others unless ``full``) on the four
    decode products, beside bfloat16's and the current table's shapes; stop starting shapes after ``budget`` seconds.
    Prints per shape and product the GB/s of weights and the share of ``bandwidth_gbs``, then per format the fastest
    shape over the layer, the fastest per product and the QUANT_LAUNCH lines that take them. Each shape is timed after
    ``warm_up_seconds`` of replays; bfloat16's layer is timed again at the end (a drift says the clocks moved)."""
    device = vulkan.get_device()
    started = time.perf_counter()
    names, kinds = [p[0] for p in SWEEP_PRODUCTS], sweep_kinds()
    print(f"device: {device.name}; decode products of a Llama layer (hidden {SWEEP_PRODUCTS[0][2]}, ffn "
          f"{SWEEP_PRODUCTS[3][2]}) at batch 1, {layers} layers of distinct "
          f"weights; GB/s of weights and % of {bandwidth_gbs:.0f} GB/s per product: "
          f"{', '.join(f'{n} ({k})' for n, k in zip(names, kinds))}; then the layer: GB/s, % of the bound, time, "
          f"speed against bfloat16's layer", flush=True)
    results = {"device": device.name, "bandwidth_gbs": bandwidth_gbs, "layers": layers, "kinds": kinds,
               "formats": {}}

    def run(fmt, shape, launch, weights):
        seq = record_products(device, fmt, weights, launch)
        times = time_products(seq, repeats, warm_up_seconds)
        del seq
        sizes = product_bytes(fmt)
        gbps = [n / t * 1e-9 for n, t in zip(sizes, times)]
        layer_gbps = sum(sizes) / sum(times) * 1e-9
        return {"shape": shape, "us": [t * 1e6 for t in times], "gbps": gbps, "layer_gbps": layer_gbps,
                "layer_of_bound": layer_gbps / bandwidth_gbs}

    def line(tag, r, mark=""):
        cells = "  ".join(f"{g:5.0f} {100 * g / bandwidth_gbs:3.0f}%" for g in r["gbps"])
        speed = f"  {sum(base['us']) / sum(r['us']):4.2f}x bf16" if base is not r else ""
        print(f"  {tag:16s} {cells}  | {r['layer_gbps']:5.0f} GB/s {100 * r['layer_of_bound']:3.0f}%"
              f"  {sum(r['us']):7.1f} us{speed}{mark}", flush=True)

    base = None
    base = run(None, None, None, sweep_weights(device, None, layers))
    results["bfloat16"] = base
    print("bfloat16 (its default shape)")
    line("default", base)
    table = {}
    for index, fmt in enumerate(formats):
        # the first format may take 55% of the budget, each other an equal share of the rest (and what is left over)
        share = 1.0 if len(formats) == 1 else 0.55 + 0.45 * index / (len(formats) - 1)
        deadline = started + budget * share
        if time.perf_counter() > deadline:
            print(f"{fmt}: not swept (its share of the {budget:.0f} s budget is spent)", flush=True)
            continue
        current = [KD.quant_launch(fmt, kind) for kind in kinds]
        print(f"{fmt}: (subgroups of 32 lanes, units in flight, pairs together, split k[, units side by side]); "
              f"the table now: "
              f"{dict(zip(kinds, current))}", flush=True)
        weights = sweep_weights(device, fmt, layers)
        now = run(fmt, "table", None, weights)
        line("the table", now)
        runs = []
        for shape in (KD.QUANT_SWEEP_SHAPES if index == 0 or full else KD.QUANT_SWEEP_SHORT):
            if time.perf_counter() > deadline:
                print(f"  {fmt}'s share of the {budget:.0f} s budget is spent: its other shapes not timed", flush=True)
                break
            try:
                r = run(fmt, shape, in_subgroups(device, shape), weights)
            except Exception as e:  # a shape the device refuses (too many registers, workgroup too large)
                print(f"  {str(shape):16s} failed: {str(e).splitlines()[0][:100]}")
                continue
            runs.append(r)
            now_for = [kinds[i] for i, c in enumerate(current) if c == shape]
            line(str(shape), r, f"  <- the table's for {', '.join(now_for)}" if now_for else "")
        del weights
        if not runs:
            continue
        best = min(runs, key=lambda r: sum(r["us"]))
        own = [min(runs, key=lambda r, i=i: r["us"][i]) for i in range(len(SWEEP_PRODUCTS))]
        per_kind = {kind: o["shape"] for kind, o, i in zip(kinds, own, range(len(kinds)))
                    if o["shape"] != best["shape"] and o["us"][i] < 0.97 * best["us"][i]}
        combined_us = [own[i]["us"][i] if kinds[i] in per_kind else best["us"][i] for i in range(len(kinds))]
        sizes = product_bytes(fmt)
        combined = sum(sizes) / sum(combined_us) * 1e-3  # bytes per microsecond -> GB/s
        print(f"  fastest over the layer: {best['shape']}: {best['layer_gbps']:.0f} GB/s, "
              f"{100 * best['layer_of_bound']:.0f}% of the bound, {sum(base['us']) / sum(best['us']):.2f}x bfloat16's "
              f"layer (the table now: {now['layer_gbps']:.0f} GB/s)")
        for i, name in enumerate(names):
            print(f"  fastest {name} ({kinds[i]}): {own[i]['shape']} {own[i]['gbps'][i]:.0f} GB/s "
                  f"{100 * own[i]['gbps'][i] / bandwidth_gbs:.0f}% ({best['gbps'][i]:.0f} in the layer's fastest)")
        print(f"  each kind in its own fastest shape: {combined:.0f} GB/s, {100 * combined / bandwidth_gbs:.0f}% of "
              f"the bound, {sum(base['us']) / sum(combined_us):.2f}x bfloat16's layer (goal: 60%, 2x)")
        print("  QUANT_LAUNCH lines (core/vkformers/engine/kernels/decode.py):\n"
              + launch_table(fmt, best["shape"], per_kind), flush=True)
        table[fmt] = (best["shape"], per_kind)
        results["formats"][fmt] = {"table": now, "runs": runs, "best": best["shape"], "per_kind": per_kind,
                                   "combined_gbps": combined, "combined_of_bound": combined / bandwidth_gbs,
                                   "combined_vs_bf16": sum(base["us"]) / sum(combined_us)}
    again = run(None, None, None, sweep_weights(device, None, layers))
    results["bfloat16_at_end"] = again
    drift = again["layer_gbps"] / base["layer_gbps"] - 1.0
    print(f"bfloat16 again at the end: {again['layer_gbps']:.0f} GB/s, {100 * drift:+.1f}% from the first"
          + (" (more than 5%: the clocks moved during the sweep, its figures do not compare)" if abs(drift) > 0.05
             else ""), flush=True)
    if table:
        print("QUANT_LAUNCH = {\n" + "\n".join(launch_table(f, d, k) for f, (d, k) in table.items()) + "\n}")
    print(f"sweep time: {time.perf_counter() - started:.0f} s", flush=True)
    return results


def bench_lora_step(config, fmt: str | None, batch: int, seq: int, steps: int, dry_run: bool = False) -> dict:
    """LoRA steps (QLORA, bf16, gradient checkpointing) on a base in ``fmt`` (None: bfloat16): tokens/s, peak GiB,
    and where the memory goes (``memory``: GiB of the base weights, adapters, optimizer state, and the step's plan
    as lazy.memory_report() gives it). ``dry_run``: record the step's plan without running it (memory only)."""
    gc.collect()
    start_bytes = vulkan.buffer_memory()["live_bytes"]
    vulkan.reset_peak_buffer_memory()

    def held():
        return (vulkan.buffer_memory()["live_bytes"] - start_bytes) / 2**30

    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(tiled_weights(model, fmt), dtype="bfloat16", requires_grad=False)
    memory = {"base_gib": held()}
    apply_lora(model, LoraConfig(**QLORA))
    weights_gib = held()
    memory["adapters_gib"] = weights_gib - memory["base_gib"]
    trainer = Trainer(model, TrainingConfig(steps=steps + 2, batch_size=batch, seq_len=seq, lr=1e-4,
                                            schedule="constant", precision="bf16", gradient_checkpointing=True),
                      train_batches=None)
    memory["optimizer_gib"] = held() - weights_gib
    ids = np.random.default_rng(1).integers(0, config["vocab_size"], (batch, seq)).astype(np.int32)
    batches = [(ids, ids.copy())]
    if dry_run:
        return {**record_step_only(trainer, batches), "weights_gib": weights_gib,
                "peak_gib": (vulkan.buffer_memory()["peak_bytes"] - start_bytes) / 2**30, "memory": memory}
    first = time.perf_counter()
    losses = [trainer.train_step(batches).loss]  # records the step
    first = time.perf_counter() - first
    memory["plan"] = lazy.memory_report()
    if steps:
        losses.append(trainer.train_step(batches).loss)  # the first replay
    start = time.perf_counter()
    for _ in range(max(1, steps)):  # steps 0: the first replay alone
        losses.append(trainer.train_step(batches).loss)
    seconds = (time.perf_counter() - start) / max(1, steps)
    out = {"tok_s": ids.size / seconds, "step_s": seconds, "first_step_s": first, "weights_gib": weights_gib,
           "peak_gib": (vulkan.buffer_memory()["peak_bytes"] - start_bytes) / 2**30, "losses": losses,
           "memory": memory}
    del trainer, model
    gc.collect()
    return out


def record_step_only(trainer, batches) -> dict:
    """Build one training step's graph and record its plan without submitting it (lazy._run made a no-op): the
    memory the step allocates, on any device, in the time recording takes. No loss comes out."""
    run = lazy._run
    lazy._run = lambda plan, seq=None: None
    try:
        start = time.perf_counter()
        trainer.model.train()  # as train_step: gradient checkpointing applies in training mode
        batches = [tuple(np.asarray(a, np.int32) for a in b) for b in batches]
        stats, factor = trainer._build_step(batches, None, trainer._loss_shares(batches))
        trainer._apply_update(factor)
        lazy.realize([stats.lazy])
        seconds = time.perf_counter() - start
    finally:
        lazy._run = run
    trainer.optimizer.zero_grad()
    return {"record_s": seconds, "memory_plan": lazy.memory_report()}


def print_memory(r: dict) -> None:
    """--memory: where a step's peak goes."""
    m, plan = r["memory"], r["memory"].get("plan") or r.get("memory_plan")
    gib = 2.0**30
    print(f"  peak {r['peak_gib']:.3f} GiB = base weights {m['base_gib']:.3f} + adapters {m['adapters_gib']:.3f} "
          f"+ optimizer state {m['optimizer_gib']:.3f} + the step's plan {plan['nbytes'] / gib:.3f} (+ transient)")
    print(f"  plan: intermediate values {plan.get('slots', 0) / gib:.3f} GiB in {plan.get('slot_count', 0)} slots "
          f"(live at most {plan.get('peak_live', 0) / gib:.3f}), results kept {plan.get('outputs', 0) / gib:.3f}, "
          f"inputs {plan['inputs'] / gib:.3f}, scratch and workspaces {plan['other'] / gib:.3f}; "
          f"{plan.get('in_place', 0)} values in place of their input")
    at_peak = sorted(plan.get("live_at_peak", {}).items(), key=lambda kv: -kv[1])
    if at_peak:
        print("  alive at the plan's peak (step {} of {}): ".format(plan["peak_step"], plan["steps"])
              + ", ".join(f"{name} {v / gib:.3f}" for name, v in at_peak[:8]) + " GiB; the largest: "
              + ", ".join(f"{name} {list(shape)} {dtype}" for name, shape, dtype, _ in plan["largest_at_peak"][:4]))


def bench_peft_step(config, batch: int, seq: int, steps: int) -> dict | str:
    """PyTorch + PEFT LoRA (QLORA) on a bfloat16 base with gradient checkpointing, on CUDA; or why it was skipped."""
    try:
        import torch
        from peft import LoraConfig as PeftLoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        return f"skipped ({exc.name} not installed)"
    if not torch.cuda.is_available():
        return "skipped (no CUDA device)"
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start_bytes = torch.cuda.memory_allocated()
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"}))
    model = model.to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, PeftLoraConfig(**QLORA, lora_dropout=0.0, task_type="CAUSAL_LM"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, config["vocab_size"], (batch, seq))).cuda()

    def step():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    step(), step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    seconds = (time.perf_counter() - start) / max(1, steps)
    out = {"tok_s": ids.numel() / seconds, "step_s": seconds,
           "peak_gib": (torch.cuda.max_memory_allocated() - start_bytes) / 2**30}
    model = optimizer = params = step = None  # noqa: F841 (freed before the cache is emptied)
    gc.collect()
    torch.cuda.empty_cache()
    return out


LORA_BASES = {"bf16": ("bfloat16 LoRA", None), "nf4": ("NF4 QLoRA", "nf4")}


def qlora(config, batch: int, seq: int, steps: int, bases=("bf16", "nf4"), peft: bool = True, memory: bool = False,
          dry_run: bool = False) -> dict:
    print(f"device: {vulkan.get_device().name}; LoRA r{QLORA['r']} on 7 projections, batch {batch} x {seq}, "
          f"gradient checkpointing; Llama shape hidden {config['hidden_size']}, {config['num_hidden_layers']} layers"
          + ("; recording the step only (--dry-run)" if dry_run else ""), flush=True)
    results = {"device": vulkan.get_device().name, "config": config, "batch": batch, "seq": seq, "lora": QLORA,
               "planner": lazy.MEMORY_PLANNER}
    for base in bases:
        name, fmt = LORA_BASES[base]
        r = results[name] = bench_lora_step(config, fmt, batch, seq, steps, dry_run)
        if dry_run:
            print(f"{name:14s} recorded in {r['record_s']:.1f} s  peak {r['peak_gib']:7.2f} GiB "
                  f"(weights {r['weights_gib']:.2f})", flush=True)
        else:
            print(f"{name:14s} {r['tok_s']:9.1f} tok/s  peak {r['peak_gib']:7.2f} GiB (weights {r['weights_gib']:.2f}) "
                  f"loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}", flush=True)
        if memory:
            print_memory(r)
    if dry_run:
        return results
    ref = results["PyTorch + PEFT bf16"] = bench_peft_step(config, batch, seq, steps) if peft else "skipped (--no-peft)"
    if isinstance(ref, str):
        print(f"PyTorch + PEFT bf16 {ref}")
    else:
        print(f"PyTorch + PEFT bf16 {ref['tok_s']:9.1f} tok/s  peak {ref['peak_gib']:7.2f} GiB (max_memory_allocated)")
    q, b = results.get("NF4 QLoRA"), results.get("bfloat16 LoRA")
    if q is not None:
        print("QLoRA: " + (f"{q['tok_s'] / b['tok_s']:.2f}x the bfloat16 LoRA step, " if b is not None else "")
              + ("" if isinstance(ref, str) else f"{q['tok_s'] / ref['tok_s']:.2f}x PyTorch + PEFT, ")
              + f"peak {q['peak_gib']:.2f} GiB (goal at the 8B shape, 32 layers: <= 10 GiB)", flush=True)
    return results


def qlora_70b(layers: int, memory: bool = False, dry_run: bool = False) -> dict:
    config = dict(LLAMA_70B, num_hidden_layers=layers)
    print(f"device: {vulkan.get_device().name}; one QLoRA step (NF4, LoRA r{QLORA['r']} on 7 projections, "
          f"gradient checkpointing) of the 70B shape, {layers} layers, batch 1 x 1024", flush=True)
    r = bench_lora_step(config, "nf4", 1, 1024, 0, dry_run)
    if dry_run:
        print(f"NF4 QLoRA 70B step recorded in {r['record_s']:.1f} s  peak {r['peak_gib']:.2f} GiB "
              f"(weights {r['weights_gib']:.2f}; goal: under 48 GiB)", flush=True)
    else:
        print(f"NF4 QLoRA 70B step {r['step_s']:.2f} s (the first, recording it: {r['first_step_s']:.2f} s)  "
              f"peak {r['peak_gib']:.2f} GiB "
              f"(weights {r['weights_gib']:.2f}; goal: under 48 GiB)  loss {r['losses'][0]:.3f}", flush=True)
    if memory:
        print_memory(r)
    return {"device": vulkan.get_device().name, "config": config, "batch": 1, "seq": 1024, "lora": QLORA,
            "planner": lazy.MEMORY_PLANNER, **r}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", help="block formats to compare with bfloat16 (q4_k,q8_0; also q4_k_m: "
                        f"llama.cpp's Q4_K_M layout; --sweep: {SWEEP_FORMATS})")
    parser.add_argument("--layers", type=int, help="layers (32; --sweep: 8)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--bandwidth-gbs", type=float, default=4800.0,
                        help="the device's memory bandwidth for the decode bound (H200: 4800)")
    parser.add_argument("--quick", action="store_true", help="a small shape (hidden 512, 2 layers) for a CPU device")
    parser.add_argument("--json", metavar="OUT")
    parser.add_argument("--sweep", action="store_true", help="time the fused decode products' launch shapes instead")
    parser.add_argument("--repeats", type=int, default=5, help="--sweep: replays per shape")
    parser.add_argument("--warm-up", type=float, default=WARM_UP_SECONDS,
                        help="--sweep: seconds of untimed replays before each shape's timing")
    parser.add_argument("--budget", type=float, default=300.0,
                        help="--sweep: seconds after which no further shape is started (the first format may take "
                             "55%% of them, the others share the rest)")
    parser.add_argument("--full", action="store_true",
                        help="--sweep: every shape of QUANT_SWEEP_SHAPES for every format, not only the first")
    parser.add_argument("--qlora", action="store_true", help="time QLoRA steps against bfloat16 LoRA instead")
    parser.add_argument("--qlora-70b", action="store_true", help="one QLoRA step of the 70B shape instead")
    parser.add_argument("--batch", type=int, default=4, help="--qlora: sequences per step")
    parser.add_argument("--seq", type=int, default=512, help="--qlora: tokens per sequence")
    parser.add_argument("--steps", type=int, default=5, help="--qlora: timed steps (after 2 untimed)")
    parser.add_argument("--memory", action="store_true",
                        help="--qlora, --qlora-70b: print where each step's peak memory goes")
    parser.add_argument("--no-peft", action="store_true", help="--qlora: leave PyTorch + PEFT out")
    parser.add_argument("--dry-run", action="store_true",
                        help="--qlora, --qlora-70b: record each step's plan without running it (memory figures only)")
    parser.add_argument("--planner", choices=("liveness", "exact"), default="liveness",
                        help="--qlora, --qlora-70b: the lazy engine's memory planner (exact: the old reuse of freed "
                             "buffers of one dtype and size only)")
    args = parser.parse_args(argv)
    if args.qlora or args.qlora_70b:
        lazy.MEMORY_PLANNER = args.planner
        if args.qlora_70b:
            results = qlora_70b(args.layers or LLAMA_70B["num_hidden_layers"], args.memory, args.dry_run)
        else:
            config = dict(LLAMA3_8B, num_hidden_layers=args.layers or LLAMA3_8B["num_hidden_layers"])
            if args.quick:
                config.update(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=2,
                              vocab_size=4096)
            bases = [f for f in (args.formats or "bf16,nf4").split(",") if f]
            if any(b not in LORA_BASES for b in bases):
                parser.error(f"--qlora: --formats takes {', '.join(LORA_BASES)}")
            results = qlora(config, args.batch, args.seq, args.steps, bases, not args.no_peft, args.memory,
                            args.dry_run)
        write_results(args.json, results)
        return 0
    if args.sweep:
        global SWEEP_PRODUCTS
        if args.quick:
            SWEEP_PRODUCTS = decode_products(512, 1536, 4, 2)
        formats = [f for f in (args.formats or SWEEP_FORMATS).split(",") if f]
        write_results(args.json, sweep(formats, args.layers or 8, args.repeats, args.bandwidth_gbs, args.budget,
                                       args.full, args.warm_up))
        return 0
    args.formats = args.formats or "q4_k,q8_0"
    args.layers = args.layers or LLAMA3_8B["num_hidden_layers"]
    config = dict(LLAMA3_8B, num_hidden_layers=args.layers)
    if args.quick:
        config.update(hidden_size=512, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=4096)
    prompt = np.random.default_rng(1).integers(0, config["vocab_size"], (1, args.prompt_len)).astype(np.int32)
    device = vulkan.get_device()
    print(f"device: {device.name}; Llama shape hidden {config['hidden_size']}, {config['num_hidden_layers']} layers")
    results = {"device": device.name, "config": config, "formats": {}}
    base = None
    for fmt in [None, *[f for f in args.formats.split(",") if f]]:
        name = fmt or "bfloat16"
        r = bench_format(config, fmt, prompt, args.new_tokens, args.bandwidth_gbs)
        results["formats"][name] = r
        base = base or r
        print(f"{name:9s} weights {r['weights_gib']:6.2f} GiB | decode b1 {r['decode_b1_tok_s']:8.1f} tok/s "
              f"({r['decode_b1_tok_s'] / base['decode_b1_tok_s']:.2f}x bf16; {100 * r['decode_b1_of_bound']:.0f}% "
              f"of the {r['decode_b1_bound_tok_s']:.0f} tok/s bound) | prefill {args.prompt_len} "
              f"{r['prefill_tok_s']:9.1f} tok/s ({r['prefill_tok_s'] / base['prefill_tok_s']:.2f}x bf16)", flush=True)
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
