"""LoRA adapters served side by side on one base (models/lora.py's serve_adapters, ``vkformers serve --adapter
NAME=DIR``): a batch whose rows take different adapters, or none, gives each row what the model with that adapter
alone gives (PEFT's unmerged LoRA, models/lora.py's load_adapter), in one forward, through the scheduler (joining
a running batch, replayed decode steps, paged and prefix-cached prompts) and through the HTTP routes, on the tiny
random Llama of tests/data/pipeline."""
from __future__ import annotations

import numpy as np
import pytest

from pathlib import Path

from test_serve import SERVED, encode, free_port, openai, prefill_bucket, reference_tokens, serving, wait_for, \
    web  # noqa: F401  (web: a fixture)

import vkformers as vkf
from vkformers.cli import main
from vkformers.cli import serve as cli_serve
from vkformers.models.batching import BatchScheduler, Request, SamplingParams
from vkformers.models.loading import AutoModelForCausalLM, AutoTokenizer
from vkformers.models.lora import (LoraConfig, LoraError, LoraLinear, ServedLoraLinear, apply_lora, load_adapter,
                                   save_adapter, serve_adapters)

# Two adapters unlike each other: ranks, targets, scaling rules
ADAPTERS = {"terse": LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
            "verbose": LoraConfig(r=3, lora_alpha=6, use_rslora=True, target_modules=["v_proj", "o_proj", "down_proj"])}
PROMPTS = ["the capital of france is", "hello", "once upon a time there was a", "gpu"]
# The logits of a row with an adapter against the model with that adapter alone (float32: only the order of the
# low-rank products' sums differs)
LOGITS_TOLERANCE = 1e-4


MODEL = Path(__file__).parent / "data" / "pipeline"  # a tiny random Llama (safetensors) and its BPE tokenizer


def load_base(path, **options):
    return AutoModelForCausalLM.from_pretrained(path, dtype="float32", requires_grad=False, **options)


@pytest.fixture(scope="module")
def tiny():
    return MODEL, AutoTokenizer.from_pretrained(MODEL), load_base(MODEL)


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    """name -> folder of a saved adapter with random non-zero B matrices."""
    path = tiny[0]
    folders = {}
    for seed, (name, config) in enumerate(ADAPTERS.items()):
        model = load_base(path)
        apply_lora(model, LoraConfig(**{**config.__dict__, "extra": {}}), seed=seed)
        rng = np.random.default_rng(10 + seed)
        for _, module in model.named_modules():
            if isinstance(module, LoraLinear):
                b = rng.standard_normal(module.lora_B.weight.shape).astype(np.float32)
                module.lora_B.weight = vkf.parameter(b)
        folders[name] = tmp_path_factory.mktemp(name)
        save_adapter(model, folders[name])
    return folders


def adapted(path, folder, **options):
    """The tiny model with one adapter, unmerged (None: the base model)."""
    model = load_base(path, **options)
    return model if folder is None else load_adapter(model, folder)


def served(path, adapters, **options):
    model = load_base(path, **options)
    return model, serve_adapters(model, adapters)


def scheduler_with(path, tokenizer, adapters, **options):
    model, selector = served(path, adapters)
    return BatchScheduler(model, tokenizer, adapters=selector, **options)


def test_a_batch_of_rows_with_different_adapters_matches_each_alone(tiny, adapters):
    path, tokenizer, _ = tiny
    model, selector = served(path, adapters)
    assert selector.names == list(ADAPTERS) and selector.columns == 5
    targeted = {name for name, m in model.named_modules() if isinstance(m, ServedLoraLinear)}
    assert {name.rsplit(".", 1)[-1] for name in targeted} == {"q_proj", "v_proj", "o_proj", "down_proj"}
    # a decode step keeps the fused kernels, the adapters' products added where the bias goes
    layers = [m for _, m in model.named_modules() if hasattr(m, "_fused_decode_plan")]
    assert layers and all(layer._fused_decode_plan()["gate_up"] is not None for layer in layers)
    rows = [0, 1, 2, 1]  # base, terse, verbose, terse
    ids = np.array([encode(tokenizer, "the quick brown fox jumps")[:5]] * len(rows), np.int64)
    ids[1:, 0] = [5, 6, 7]  # rows unlike one another
    scales = vkf.Tensor(selector.row_scales(rows))
    with selector.selecting(scales):
        logits = model(ids).logits.numpy()
    assert np.allclose(model(ids).logits.numpy()[0], logits[0], atol=1e-6)  # outside: the base model
    names = [None, *ADAPTERS]
    references = {name: adapted(path, None if name is None else adapters[name])(ids).logits.numpy() for name in names}
    for row, adapter in enumerate(rows):
        expected = references[names[adapter]][row]
        assert np.abs(logits[row] - expected).max() <= LOGITS_TOLERANCE * np.abs(expected).max()
    # the adapters change the output: the comparison above is not between equal models
    for name in ADAPTERS:
        assert np.abs(references[name][1] - references[None][1]).max() > 0.1 * np.abs(references[None][1]).max()


@pytest.mark.parametrize("paged", [False, True])
def test_requests_with_different_adapters_share_a_running_batch(tiny, adapters, monkeypatch, paged):
    """Greedy requests for the base model and each adapter, some joining the running batch later, each gives
    what generate gives with its adapter alone; the decode steps replay (one persistent tensor of choices per batch
    size, rewritten as rows change)."""
    prefill_bucket(monkeypatch, 0)
    path, tokenizer, _ = tiny
    options = dict(kv_blocks=96, page_size=4) if paged else {}
    scheduler = scheduler_with(path, tokenizer, adapters, max_batch=4, **options)
    jobs = [(encode(tokenizer, PROMPTS[i % len(PROMPTS)]), i % 3, 4 + 2 * i) for i in range(6)]
    scheduler.start()
    try:
        requests = []
        for index, (ids, adapter, length) in enumerate(jobs):
            if index >= 3:
                steps = scheduler.metrics.steps
                wait_for(lambda: scheduler.metrics.steps >= steps + 2 or all(r.finished for r in requests))
            requests.append(scheduler.submit(Request(ids, SamplingParams(max_tokens=length, temperature=0),
                                                     lambda update: None, [], adapter=adapter)))
        wait_for(lambda: all(r.finished for r in requests))
        replayed = scheduler.metrics.replayed_steps
    finally:
        scheduler.close()
    assert replayed > 0
    names = [None, *ADAPTERS]
    references = {name: adapted(path, None if name is None else adapters[name]) for name in names}
    for request, (ids, adapter, length) in zip(requests, jobs):
        expected = reference_tokens(references[names[adapter]], ids, length)
        assert request.generated == [int(t) for t in expected], (adapter, ids)


def test_a_prompt_cached_for_one_adapter_is_not_reused_for_another(tiny, adapters, monkeypatch):
    """The same long prompt for the base model, then each adapter: their keys and values differ, so no request
    takes another's prefix blocks, and each output is its adapter's."""
    prefill_bucket(monkeypatch, 0)
    path, tokenizer, _ = tiny
    prompt = encode(tokenizer, "you are a helpful model on any gpu through vulkan compute; answer: " + PROMPTS[0])
    assert len(prompt) >= 12
    names = [None, *ADAPTERS]
    outputs, hits = [], []
    scheduler = scheduler_with(path, tokenizer, adapters, max_batch=2, kv_blocks=64, page_size=4)
    scheduler.start()
    try:
        for adapter in (0, 1, 2, 1):
            request = scheduler.submit(Request(prompt, SamplingParams(max_tokens=5, temperature=0), lambda u: None,
                                               [], adapter=adapter))
            wait_for(lambda: request.finished)
            outputs.append((adapter, request.generated))
            hits.append(scheduler.metrics.prefix_hit_tokens)
    finally:
        scheduler.close()
    assert hits[:3] == [0, 0, 0] and hits[3] > 0  # only the repeat of an adapter's prompt finds its blocks
    for adapter, tokens in outputs:
        reference = adapted(path, None if adapter == 0 else adapters[names[adapter]])
        assert tokens == [int(t) for t in reference_tokens(reference, prompt, 5)]


def test_adapters_that_cannot_be_served_side_by_side_are_refused(tiny, adapters, tmp_path):
    path = tiny[0]
    model = load_base(path)
    apply_lora(model, LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    save_adapter(model, tmp_path / "whole")
    with pytest.raises(LoraError, match="trains whole modules.*--adapter DIR"):
        served(path, {"whole": tmp_path / "whole"})
    with pytest.raises(LoraError, match="carries LoRA layers already"):
        serve_adapters(adapted(path, adapters["terse"]), {"verbose": adapters["verbose"]})
    other = load_base(path)
    apply_lora(other, LoraConfig(r=2, target_modules=["k_proj"]))
    save_adapter(other, tmp_path / "other")
    (tmp_path / "other" / "adapter_config.json").write_text(
        (tmp_path / "other" / "adapter_config.json").read_text().replace('"k_proj"', '"q_proj"'))
    with pytest.raises(LoraError, match="does not fit this model"):
        served(path, {"other": tmp_path / "other"})


FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("fixture, targets, quantization", [
    ("qwen2", ["q_proj", "k_proj", "v_proj", "up_proj"], None),  # biased q/k/v: the update adds to the bias
    ("phi3", ["qkv_proj", "gate_up_proj", "o_proj", "down_proj"], None),  # fused projections: split by blocks
    ("pipeline", ["q_proj", "v_proj", "gate_proj", "down_proj"], "q4_0"),  # packed weights (QLoRA's served)
])
def test_decode_steps_of_served_adapters_match_each_adapter_alone(fixture, targets, quantization, tmp_path):
    """generate's decode steps (fused kernels, the adapters' products added where the bias goes) of a batch whose
    rows take different adapters give each row the logits of its adapter alone (PEFT's unmerged LoRA, unfused)."""
    path = MODEL if fixture == "pipeline" else FIXTURES / fixture
    packed = dict(quantization=quantization) if quantization else {}
    folders = {}
    for seed, name in enumerate(["first", "second"]):
        model = load_base(path)
        apply_lora(model, LoraConfig(r=2 + seed, lora_alpha=4, target_modules=targets), seed=seed)
        rng = np.random.default_rng(20 + seed)
        for _, module in model.named_modules():
            if isinstance(module, LoraLinear):
                module.lora_B.weight = vkf.parameter(rng.standard_normal(module.lora_B.weight.shape).astype(np.float32))
        folders[name] = tmp_path / name
        save_adapter(model, folders[name])
    model, selector = served(path, folders, **packed)
    layers = [m for _, m in model.named_modules() if hasattr(m, "_fused_decode_plan")]
    assert layers and all(layer._fused_decode_plan() is not None for layer in layers)
    ids = np.array([[3, 9, 4, 15, 2], [7, 7, 1, 12, 30], [5, 8, 2, 2, 19]], np.int64)
    rows = [2, 0, 1]
    options = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                   output_logits=True)
    with selector.selecting(vkf.Tensor(selector.row_scales(rows))):
        served_out = model.generate(ids, **options)
    for row, adapter in enumerate(rows):
        alone = adapted(path, None if adapter == 0 else folders[["first", "second"][adapter - 1]], **packed)
        expected = alone.generate(ids[row:row + 1], **options)
        assert served_out.sequences[row].tolist() == expected.sequences[0].tolist()
        for got, want in zip(served_out.logits, expected.logits):
            want = np.asarray(want)[0]
            assert np.abs(np.asarray(got)[row] - want).max() <= LOGITS_TOLERANCE * np.abs(want).max()


def test_an_adapter_on_a_mixtures_experts_is_refused_before_it_serves(tmp_path):
    """A mixture's experts run on lists of tokens, not one row per request, so rows of one batch cannot take
    different adapters there: refused when the adapters go on the model, not at the first request for one (which
    would fail every request of its batch). Its attention layers take adapters side by side."""
    path = FIXTURES / "mixtral"
    for name, targets in (("experts", ["q_proj", "w1"]), ("attention", ["q_proj", "v_proj"])):
        model = load_base(path)
        apply_lora(model, LoraConfig(r=2, target_modules=targets))
        save_adapter(model, tmp_path / name)
    with pytest.raises(LoraError, match=r"experts\.0\.w1 reads rows that are not one batch row per request"):
        served(path, {"experts": tmp_path / "experts"})
    model, selector = served(path, {"attention": tmp_path / "attention"})
    assert selector.names == ["attention"]


def test_a_model_serving_adapters_is_not_saved_with_them(tiny, adapters, tmp_path):
    model, _ = served(tiny[0], adapters)
    with pytest.raises(LoraError, match="serving adapters side by side.*before serve_adapters"):
        model.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()


def test_adapter_names_on_the_command_line():
    assert cli_serve.adapter_options([]) == (None, {})
    assert cli_serve.adapter_options(["./run/final"]) == ("./run/final", {})
    assert cli_serve.adapter_options(["sql=./a", "chat=/b/c"]) == (None, {"sql": "./a", "chat": "/b/c"})
    # hub repo ids as vLLM's --lora-modules name=org/repo; kept as given ("./a" is no repo id: a missing folder)
    assert cli_serve.adapter_options(["org/merged-lora", "sql=org/sql-lora"]) == ("org/merged-lora",
                                                                                 {"sql": "org/sql-lora"})
    with pytest.raises(cli_serve.VkformersError, match="one --adapter DIR"):
        cli_serve.adapter_options(["./a", "./b"])
    with pytest.raises(cli_serve.VkformersError, match="twice"):
        cli_serve.adapter_options(["sql=./a", "sql=./b"])


def test_the_routes_serve_each_adapter_by_name(tiny, adapters, web):  # noqa: F811 (the fixture)
    """/v1/models lists the base model and each adapter (its parent the base); a completion names the adapter it
    wants in ``model`` and gets that adapter's output; an unknown name is a 404."""
    path, tokenizer, _ = tiny
    scheduler = scheduler_with(path, tokenizer, adapters, max_batch=4).start()
    with serving(scheduler, tokenizer, adapters=adapters) as served:
        client = served["client"]
        cards = client.models.list().data
        assert [m.id for m in cards] == [SERVED, *ADAPTERS]
        assert [getattr(m, "parent", None) for m in cards] == [None, SERVED, SERVED]
        texts = {name: client.completions.create(model=name, prompt=PROMPTS[1], max_tokens=5, temperature=0)
                 for name in (SERVED, *ADAPTERS)}
        with pytest.raises(openai.NotFoundError, match="terse"):
            client.completions.create(model="nobody", prompt=PROMPTS[1], max_tokens=5)
    ids = encode(tokenizer, PROMPTS[1])
    for name, response in texts.items():
        assert response.model == name
        reference = adapted(path, adapters.get(name))
        tokens = reference_tokens(reference, ids, 5, cli_serve.eos_ids(reference, tokenizer))
        assert response.choices[0].text == tokenizer.decode(tokens, skip_special_tokens=True)


def test_an_adapter_named_as_the_base_model_is_refused(tiny, adapters, web, capsys):  # noqa: F811 (the fixture)
    path = tiny[0]
    for model in (["--model", str(path)], [str(path)]):  # the model as vLLM's `vllm serve MODEL` names it too
        assert main(["serve", *model, "--served-model-name", "tiny", "--port", str(free_port()), "--max-num-seqs", "2",
                     "--adapter", f"tiny={adapters['terse']}"]) == 1
        assert capsys.readouterr().err == ("vkformers serve: error: --adapter tiny=...: the base model is served as "
                                           "'tiny'; name the adapter otherwise\n")
    assert main(["serve", str(path), "--model", "other", "--port", str(free_port())]) == 1
    assert "the model is given twice" in capsys.readouterr().err
