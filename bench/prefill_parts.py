"""A prompt's forward built in Python, submitted in parts against one realization, in one process: what submitting
the residual stream every few layers (models/module.py, Module.layer_parts) gains where the device's share is large.

Random weights at the Llama-3-8B shape (--shape tinyllama: TinyLlama's), batch 1, bfloat16; for each prompt length,
calls alternate between the modes (parts of at least 8 layers, the default; parts of at least 4; one realization),
three rounds of five calls each after two warm-up calls per mode; medians. It also splits one realization's time
into building the graph, realizing it on the host and the submit's wait (the device's share).

    python bench/prefill_parts.py [--shape llama3-8b] [--layers 32] [--lengths 512,2048] [--json OUT]
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from common import write_results
from host import ReplayClock
from llama import SHAPES, random_weights

import vkformers as vkf
from vkformers.engine import lazy
from vkformers.models import module
from vkformers.models.loading import AutoModelForCausalLM

ROUNDS, CALLS = 3, 5


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args(argv)
    config = dict(SHAPES[args.shape])
    if args.layers:
        config["num_hidden_layers"] = args.layers
    layers = config["num_hidden_layers"]
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(random_weights(model, shared=True), dtype="bfloat16", requires_grad=False)
    model.eval()
    default = (module.SUBMIT_MIN_TOKENS, module.SUBMIT_MIN_LAYERS)
    modes = {"parts": default, "parts of 4": (default[0], 4), "one realization": (1 << 30, default[1])}
    results = []
    for length in (int(v) for v in args.lengths.split(",")):
        ids = np.random.default_rng(0).integers(0, config["vocab_size"], (1, length)).astype(np.int32)
        seconds = {m: [] for m in modes}
        with vkf.no_grad():
            for mode in list(modes) * 2:
                module.SUBMIT_MIN_TOKENS, module.SUBMIT_MIN_LAYERS = modes[mode]
                model(ids).logits[:, -1].numpy()
            for _ in range(ROUNDS):
                for mode in modes:
                    module.SUBMIT_MIN_TOKENS, module.SUBMIT_MIN_LAYERS = modes[mode]
                    for _ in range(CALLS):
                        start = time.perf_counter()
                        model(ids).logits[:, -1].numpy()
                        seconds[mode].append(time.perf_counter() - start)
            module.SUBMIT_MIN_TOKENS, module.SUBMIT_MIN_LAYERS = modes["one realization"]
            split = []  # one realization: (building the graph, realizing it on the host, waiting for the device) ms
            for _ in range(CALLS):
                start = time.perf_counter()
                logits = model(ids).logits[:, -1]
                built = time.perf_counter()
                with ReplayClock() as clock:
                    logits.numpy()
                done = time.perf_counter()
                split.append(((built - start) * 1e3, (done - built - clock.seconds) * 1e3, clock.seconds * 1e3))
        build, host, device = np.median(np.array(split), axis=0)
        print(f"{args.shape} ({layers} layers) prefill {length}, one realization: building {build:.1f} ms, realizing "
              f"on the host {host:.1f} ms, submit and wait {device:.1f} ms", flush=True)
        results.append({"length": length, "mode": "one realization, split", "build_ms": float(build),
                        "host_ms": float(host), "device_ms": float(device)})
        whole = float(np.median(seconds["one realization"]))
        stream = vkf.Tensor(np.zeros((1, length, config["hidden_size"]), np.float32), dtype="bfloat16")
        for mode, (tokens, min_layers) in modes.items():
            module.SUBMIT_MIN_TOKENS, module.SUBMIT_MIN_LAYERS = tokens, min_layers
            parts, median = model.layer_parts(stream, layers), float(np.median(seconds[mode]))
            results.append({"length": length, "mode": mode, "parts": parts, "ms": median * 1e3,
                            "tok_s": length / median, "against_one": whole / median})
            print(f"{args.shape} ({layers} layers) prefill {length}, {mode}: {parts} part(s), {median * 1e3:.1f} ms, "
                  f"{length / median:,.0f} tok/s, {whole / median:.2f}x one realization", flush=True)
        module.SUBMIT_MIN_TOKENS, module.SUBMIT_MIN_LAYERS = default
    print(f"plan cache: {lazy.plan_cache_info()}", flush=True)
    write_results(args.json, {"device": vkf.get_device().name, "shape": args.shape, "layers": layers,
                              "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
