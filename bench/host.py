"""Host time of a step built in Python: what a decode step costs when its graph is built, scheduled and matched
to a recorded plan on the host, against the same step replayed from a capture (no Python graph), in one run.

A 22-layer Llama of hidden 64 keeps the GPU's share small, so the figures are the engine's host overhead per
step (graph building, scheduling, the plan lookup, the readback), as a model family whose decode steps are not
captured (DSA, Gemma 3n) pays it every token, and every model pays it for a prompt's first forward.

It also times a prompt's forward built in Python (--prompt-len tokens, no cache): building its graph, realizing it
on the host once its plan is recorded (scheduling, the plan lookup, the readback), and recording a new length's plan
on the host: what every built-per-call prefill and training step pays.

--checkpoint DIR measures a checkpoint's decode step instead (a recurrent or hybrid model, tests/fixtures/bamba say,
whose step replays from recurrent states kept in place), built in Python and replayed, per step and per layer.

    python bench/host.py [--layers 22] [--new-tokens 32] [--prompt-len 16] [--json OUT]
    python bench/host.py --checkpoint tests/fixtures/bamba [--batch 4]
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from common import write_results
from llama import random_weights

import vkformers as vkf
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.runtime import vulkan

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False)
REPEATS = 5  # generate calls per measure; the median counts


class ReplayClock:
    """Seconds spent in Sequence.replay (submit and wait: the device's share) while active."""

    def __init__(self):
        self.seconds, self._original = 0.0, vulkan.Sequence.replay

    def __enter__(self):
        clock, original = self, self._original

        def replay(seq, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(seq, *args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - start
        vulkan.Sequence.replay = replay
        return self

    def __exit__(self, *exc):
        vulkan.Sequence.replay = self._original


def per_token(model, ids, new_tokens: int, captured: bool) -> tuple[float, float]:
    """(wall, host) milliseconds per generated token, medians over REPEATS generate calls; not ``captured``: every
    decode step built in Python (the model's capture switches off), else as the model replays."""
    switches = getattr(model, "_bench_switches", None)
    if switches is None:
        switches = {name: getattr(model, name) for name in ("capture_decode", "capture_decode_with_row_states")
                    if hasattr(model, name)}
        object.__setattr__(model, "_bench_switches", switches)
    for name, value in switches.items():
        object.__setattr__(model, name, value if captured else False)
    if not switches:
        object.__setattr__(model, "capture_decode", captured)
    generate = lambda: model.generate(ids, max_new_tokens=new_tokens, do_sample=False)  # noqa: E731
    generate()
    generate()
    walls, hosts = [], []
    for _ in range(REPEATS):
        with ReplayClock() as clock:
            start = time.perf_counter()
            generate()
            wall = time.perf_counter() - start
        walls.append(wall / new_tokens * 1e3)
        hosts.append((wall - clock.seconds) / new_tokens * 1e3)
    return float(np.median(walls)), float(np.median(hosts))


def prompt_forward(model, vocab: int, length: int, repeats: int = 9) -> tuple[float, float, float]:
    """Milliseconds of a prompt's forward built in Python (medians): building the graph, realizing it on the host
    when its plan is recorded already, and realizing a new length's plan on the host (recording it)."""
    def build_and_realize(ids) -> tuple[float, float]:
        """(ms building the graph, ms realizing it outside Sequence.replay)"""
        start = time.perf_counter()
        logits = model(ids).logits[:, -1]
        built = time.perf_counter()
        with ReplayClock() as clock:
            logits.numpy()
        return (built - start) * 1e3, (time.perf_counter() - built - clock.seconds) * 1e3

    rng = np.random.default_rng(1)
    ids = rng.integers(0, vocab, (1, length)).astype(np.int32)
    build_and_realize(ids)
    builds, hosts = zip(*(build_and_realize(ids) for _ in range(repeats)))
    records = [build_and_realize(rng.integers(0, vocab, (1, length + extra)).astype(np.int32))[1]
               for extra in range(1, repeats // 3 + 1)]  # each length records its own plan
    return float(np.median(builds)), float(np.median(hosts)), float(np.median(records))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--checkpoint", default=None, help="a checkpoint folder: its step built in Python only")
    parser.add_argument("--batch", type=int, default=1, help="rows decoded together")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args(argv)
    if args.checkpoint:
        model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype="float32", requires_grad=False)
        layers = int(model.config.get("num_hidden_layers") or 1)
        vocab = int(model.config["vocab_size"])
        ids = np.random.default_rng(0).integers(3, vocab, (args.batch, 8)).astype(np.int32)
        wall, host = per_token(model, ids, args.new_tokens, captured=False)
        replayed_wall, replayed_host = per_token(model, ids, args.new_tokens, captured=True)
        print(f"{args.checkpoint} ({layers} layers, batch {args.batch}) on {vkf.get_device().name}: decode step "
              f"built in Python {wall:.1f} ms (host {host:.1f} ms, {host / layers:.2f} ms a layer), replayed "
              f"{replayed_wall:.1f} ms (host {replayed_host:.1f} ms)", flush=True)
        write_results(args.json, {"device": vkf.get_device().name, "checkpoint": args.checkpoint, "layers": layers,
                                  "batch": args.batch, "built_ms": wall, "built_host_ms": host,
                                  "replayed_ms": replayed_wall, "replayed_host_ms": replayed_host})
        return 0
    config = dict(TINY, num_hidden_layers=args.layers)
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(random_weights(model), dtype="float32", requires_grad=False)
    model.eval()
    ids = np.random.default_rng(0).integers(0, config["vocab_size"], (1, 8)).astype(np.int32)
    built_wall, built_host = per_token(model, ids, args.new_tokens, captured=False)
    replayed_wall, replayed_host = per_token(model, ids, args.new_tokens, captured=True)
    print(f"{args.layers} layers on {vkf.get_device().name}: decode step built in Python {built_wall:.1f} ms "
          f"(host {built_host:.1f} ms), replayed {replayed_wall:.1f} ms (host {replayed_host:.1f} ms): "
          f"built / replayed {built_wall / replayed_wall:.2f}x", flush=True)
    with vkf.no_grad():
        build, realize, record = prompt_forward(model, config["vocab_size"], args.prompt_len)
    print(f"prompt of {args.prompt_len} tokens: graph built in {build:.1f} ms, realized on the host in {realize:.1f} "
          f"ms ({record:.1f} ms recording a new length's plan)", flush=True)
    write_results(args.json, {"device": vkf.get_device().name, "layers": args.layers,
                              "built_ms": built_wall, "built_host_ms": built_host,
                              "replayed_ms": replayed_wall, "replayed_host_ms": replayed_host,
                              "prompt_len": args.prompt_len, "prompt_build_ms": build,
                              "prompt_realize_host_ms": realize, "prompt_record_host_ms": record})
    return 0


if __name__ == "__main__":
    sys.exit(main())
