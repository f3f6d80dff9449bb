"""vkformers-moe's sparse block against numpy: top-k choice, routing weights (softmax / sigmoid, selection bias,
group-limited choice, renormalisation, scaling), the per-expert and the fused expert layouts, refused options and
the plugin's claims. End-to-end parity against transformers runs on the fixtures (test_decoder_parity etc.)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vkformers_moe")

import vkformers as vkf  # noqa: E402
from vkformers.models.decoder import UnsupportedConfigError  # noqa: E402
from vkformers_moe import block as moe_block  # noqa: E402
from vkformers_moe.block import MoeSpec, SparseMoeBlock, topk_mask  # noqa: E402
from vkformers.engine.ops import routing as moe_routes  # noqa: E402
from vkformers.engine.ops.routing import ExpertRoutes  # noqa: E402
from vkformers.models.loading import AutoModelForCausalLM  # noqa: E402

HIDDEN, EXPERTS, INNER, TOKENS = 8, 6, 5, 7


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _reference_weights(logits, moe: MoeSpec, bias=None):
    """The routing weights as transformers computes them, with numpy (topk by sorting)."""
    scores = np.exp(logits - logits.max(-1, keepdims=True))
    scores = scores / scores.sum(-1, keepdims=True) if moe.scoring == "softmax" else 1.0 / (1.0 + np.exp(-logits))
    choice = scores + (bias if bias is not None else 0.0)
    if moe.num_groups > 1:
        grouped = choice.reshape(len(choice), moe.num_groups, -1)
        ordered = -np.sort(-grouped, axis=-1)
        group_score = ordered[..., :2].sum(-1) if moe.group_score == "top2_sum" else ordered[..., 0]
        best = np.argsort(-group_score, axis=-1)[:, :moe.topk_groups]
        keep = np.zeros_like(group_score, dtype=bool)
        np.put_along_axis(keep, best, True, axis=-1)
        choice = np.where(np.repeat(keep, EXPERTS // moe.num_groups, axis=-1), choice, -np.inf)
    top = np.argsort(-choice, axis=-1)[:, :moe.top_k]
    weights = np.zeros_like(scores)
    np.put_along_axis(weights, top, np.take_along_axis(scores, top, -1), -1)
    if moe.norm_topk:
        weights = weights / (weights.sum(-1, keepdims=True) + moe.norm_eps)
    return weights * moe.routed_scale


def _block(moe: MoeSpec, seed=0):
    block = SparseMoeBlock(moe, HIDDEN)
    rng = np.random.default_rng(seed)
    arrays = {name: rng.standard_normal(slot.shape).astype(np.float32) * 0.5 for name, slot in block.named_slots()}
    block.load_state_dict(arrays, requires_grad=False)
    return block, arrays


@pytest.mark.parametrize("k", [1, 2, 5])
def test_topk_mask_marks_the_k_largest(k):
    values = np.random.default_rng(k).standard_normal((TOKENS, EXPERTS)).astype(np.float32)
    want = np.zeros(values.shape, bool)
    np.put_along_axis(want, np.argsort(-values, axis=-1)[:, :k], True, axis=-1)
    np.testing.assert_array_equal(topk_mask(vkf.tensor(values), k).numpy(), want)


def test_topk_mask_ties_go_to_the_lower_index():
    """The kernel chooses exactly k per row (ties to the lower index, as torch.topk), also with k >= the row's
    length, over more rows than one dimension of a dispatch grid holds on some devices."""
    values = np.array([[1.0, 3.0, 3.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    np.testing.assert_array_equal(topk_mask(vkf.tensor(values), 2).numpy(),
                                  [[False, True, True, False, False], [True, True, False, False, False]])
    np.testing.assert_array_equal(topk_mask(vkf.tensor(values), 7).numpy(), np.ones(values.shape, bool))
    nan = np.array([[np.nan, 1.0, np.nan, 2.0]], np.float32)  # NaN ranks above every number (torch.topk)
    np.testing.assert_array_equal(topk_mask(vkf.tensor(nan), 3).numpy(), [[True, False, True, True]])
    many = np.random.default_rng(3).standard_normal((70000, 3)).astype(np.float32)
    want = many >= np.sort(many, axis=-1)[:, 1:2]
    np.testing.assert_array_equal(topk_mask(vkf.tensor(many), 2).numpy(), want)


def test_topk_mask_of_long_rows_takes_rounds_of_max():
    values = np.random.default_rng(4).standard_normal((2, moe_routes.TOPK_MAX_ENTRIES + 5)).astype(np.float32)
    want = values >= np.sort(values, axis=-1)[:, -3:-2]
    np.testing.assert_array_equal(topk_mask(vkf.tensor(values), 3).numpy(), want)


ROUTERS = {
    "softmax_top2": MoeSpec(EXPERTS, 2, INNER, (True,)),
    "softmax_top3_renormalised": MoeSpec(EXPERTS, 3, INNER, (True,), norm_topk=True),
    "sigmoid_bias_groups_top2_sum": MoeSpec(EXPERTS, 2, INNER, (True,), scoring="sigmoid",
                                            selection_bias="gate.e_score_correction_bias", num_groups=3,
                                            topk_groups=2, norm_topk=True, norm_eps=1e-20, routed_scale=2.5),
    "softmax_groups_max": MoeSpec(EXPERTS, 2, INNER, (True,), num_groups=2, topk_groups=1, group_score="max",
                                  routed_scale=0.5),
}


@pytest.mark.parametrize("name", ROUTERS)
def test_routing_weights_match_numpy(name):
    moe = ROUTERS[name]
    block, arrays = _block(moe)
    bias = None
    if moe.selection_bias:
        bias = np.random.default_rng(1).standard_normal(EXPERTS).astype(np.float32) * 0.3
        block.load_buffers({f"mlp.{moe.selection_bias}": bias}, "mlp")
    x = np.random.default_rng(2).standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    logits = x @ arrays["gate.weight"].T
    got = block.routing_weights(vkf.tensor(x)).numpy()
    np.testing.assert_allclose(got, _reference_weights(logits, moe, bias), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True])
def test_block_output_is_the_weighted_sum_of_swiglu_experts(fused):
    moe = MoeSpec(EXPERTS, 2, INNER, (True,), norm_topk=True, shared="shared_expert", shared_size=3,
                  shared_gate="shared_expert_gate",
                  **(dict(experts="", fused_experts=("input_linear.weight", "output_linear.weight")) if fused else {}))
    block, a = _block(moe)
    x = np.random.default_rng(3).standard_normal((2, 3, HIDDEN)).astype(np.float32)
    flat = x.reshape(-1, HIDDEN)
    weights = _reference_weights(flat @ a["gate.weight"].T, moe)
    want = np.zeros_like(flat)
    for e in range(EXPERTS):
        if fused:
            gate_up, down = a["input_linear.weight"][e], a["output_linear.weight"][e]
            gate, up = (flat @ gate_up.T)[:, :INNER], (flat @ gate_up.T)[:, INNER:]
        else:
            gate, up = flat @ a[f"experts.{e}.gate_proj.weight"].T, flat @ a[f"experts.{e}.up_proj.weight"].T
            down = a[f"experts.{e}.down_proj.weight"]
        want += weights[:, e:e + 1] * ((_silu(gate) * up) @ down.T)
    shared = (_silu(flat @ a["shared_expert.gate_proj.weight"].T) * (flat @ a["shared_expert.up_proj.weight"].T)) \
        @ a["shared_expert.down_proj.weight"].T
    want += shared / (1.0 + np.exp(-(flat @ a["shared_expert_gate.weight"].T)))
    np.testing.assert_allclose(block(vkf.tensor(x)).numpy(), want.reshape(x.shape), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fused", [False, True])
def test_unchosen_experts_are_skipped_outside_autograd(fused):
    """Under no_grad the experts' products are gated: an expert no token chose reads none of its weights (NaN
    here, which a dense product would spread through its zero routing weight) and the output is unchanged."""
    moe = MoeSpec(EXPERTS, 2, INNER, (True,), **(dict(experts="", fused_experts=(
        "input_linear.weight", "output_linear.weight")) if fused else {}))
    block, a = _block(moe)
    x = np.random.default_rng(6).standard_normal((2, HIDDEN)).astype(np.float32)
    with vkf.no_grad():
        want = block(vkf.tensor(x)).numpy()
    unchosen = np.flatnonzero(_reference_weights(x @ a["gate.weight"].T, moe).sum(0) == 0)
    assert len(unchosen) >= 2
    poisoned = dict(a)
    for e in unchosen:
        if fused:
            for name in moe.fused_experts:
                poisoned[name] = poisoned[name].copy()
                poisoned[name][e] = np.nan
        else:
            for name in moe.expert_names:
                poisoned[f"experts.{e}.{name}.weight"] = np.full_like(a[f"experts.{e}.{name}.weight"], np.nan)
    block.load_state_dict(poisoned, requires_grad=False)
    with vkf.no_grad():
        got = block(vkf.tensor(x)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_unchosen_experts_get_no_gradient():
    moe = MoeSpec(EXPERTS, 1, INNER, (True,))
    block, a = _block(moe)
    for _, p in block.named_parameters():
        p.requires_grad = True
    x = np.random.default_rng(4).standard_normal((1, HIDDEN)).astype(np.float32)
    block(vkf.tensor(x)).sum().backward()
    chosen = int(np.argmax(x @ a["gate.weight"].T))
    for e in range(EXPERTS):
        grad = block.expert_list[e].projections[0].weight.grad
        norm = 0.0 if grad is None else float(np.abs(grad.numpy()).max())
        assert (norm > 0) == (e == chosen), (e, chosen, norm)


def test_expert_routes_list_each_experts_tokens_in_order():
    """moe_routes.comp against numpy, over more tokens than one pass of its workgroup (256)."""
    tokens, experts = 300, 5
    rng = np.random.default_rng(8)
    weights = rng.random((tokens, experts)).astype(np.float32) * (rng.random((tokens, experts)) < 0.4)
    weights[:, 3] = 0.0  # an expert no token chose
    routes = ExpertRoutes.of(vkf.tensor(weights))
    token_of_slot, slot_of_token = routes.token_of_slot.numpy(), routes.slot_of_token.numpy()
    for e in range(experts):
        chosen = np.flatnonzero(weights[:, e] != 0)
        want = np.full(tokens, -1)
        want[:len(chosen)] = chosen
        np.testing.assert_array_equal(token_of_slot[e], want)
        slots = np.full(tokens, -1)
        slots[chosen] = np.arange(len(chosen))
        np.testing.assert_array_equal(slot_of_token[e], slots)
        stacked = routes.stacked_token_of_slot.numpy()[e], routes.stacked_slot_of_token.numpy()[e]
        np.testing.assert_array_equal(stacked[0], np.where(want >= 0, want + e * tokens, -1))
        np.testing.assert_array_equal(stacked[1], np.where(slots >= 0, slots + e * tokens, -1))
    np.testing.assert_array_equal(routes.counts.numpy(), (weights != 0).sum(0))


def test_packed_routes_map_packed_rows_tokens_and_choices():
    """moe_pack.comp against numpy: experts' spans of packed rows (expert after expert, each list in token
    order), the token, choice and weight of every packed row and the inverse maps; -1 for the rows past the
    packed ones and the choices a token did not make (rows with fewer than top_k nonzero weights)."""
    tokens, experts, top_k = 300, 6, 2
    rng = np.random.default_rng(14)
    weights = np.zeros((tokens, experts), np.float32)
    for t in range(tokens):
        chosen = rng.choice(experts - 1, size=top_k, replace=False)  # expert 5: chosen by no token
        weights[t, chosen] = rng.random(top_k) + 0.1
    weights[::7, :] *= (np.arange(experts) == np.argmax(weights[::7], -1)[:, None])  # every 7th token: one choice
    packed = moe_routes.PackedRoutes.of(vkf.tensor(weights), top_k)
    rows = tokens * top_k
    counts = (weights != 0).sum(0)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    np.testing.assert_array_equal(packed.spans.numpy(), np.stack([starts, counts], 1))
    token_of_row, pair_of_row, flat_of_row = (np.full(rows, -1) for _ in range(3))
    row_of_pair, row_of_flat = np.full((top_k, tokens), -1), np.full((tokens, experts), -1)
    for e in range(experts):
        for s, t in enumerate(np.flatnonzero(weights[:, e])):
            p, j = starts[e] + s, int((weights[t, :e] != 0).sum())
            token_of_row[p], pair_of_row[p], flat_of_row[p] = t, j * tokens + t, t * experts + e
            row_of_pair[j, t], row_of_flat[t, e] = p, p
    for name, want in (("token_of_row", token_of_row), ("pair_of_row", pair_of_row), ("flat_of_row", flat_of_row),
                       ("row_of_pair", row_of_pair), ("row_of_flat", row_of_flat)):
        np.testing.assert_array_equal(getattr(packed, name).numpy(), want, err_msg=name)


ROUTED_LAYOUTS = {
    "per_expert": dict(shared="shared_expert", shared_size=3),
    "fused": dict(experts="", fused_experts=("input_linear.weight", "output_linear.weight")),
    "per_expert_scaled_inputs": dict(scale_inputs=True),
    "fused_scaled_inputs": dict(experts="", fused_experts=("input_linear.weight", "output_linear.weight"),
                                scale_inputs=True),
    "stacked": dict(stacked_experts=True, expert_names=("w1", "v1", "w2")),
    "fused_biases_clipped": dict(experts="experts", fused_experts=("gate_up_proj", "down_proj"),
                                 fused_transposed=True, fused_bias=("gate_up_proj_bias", "down_proj_bias"),
                                 gate_up_interleaved=True, swiglu_clip=(1.702, 0.7)),
}


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("layout", ROUTED_LAYOUTS)
def test_routed_experts_match_every_expert_on_every_token(monkeypatch, layout, packed):
    """A step of COMPACT_MIN_TOKENS or more tokens runs each expert on its tokens only, packed into one matrix
    (experts mode "routed", where the layout allows) or one list per expert ("listed"); its output and every gradient (input,
    router, experts) equal the dense block's, where each expert runs on every token."""
    moe = MoeSpec(EXPERTS, 2, INNER, (True,), norm_topk=True, **ROUTED_LAYOUTS[layout])
    block, _ = _block(moe)
    assert block._packable() == (layout != "fused_biases_clipped")
    packings = []
    pack = moe_block.PackedRoutes.of
    monkeypatch.setattr(moe_block.PackedRoutes, "of", lambda weights, k: packings.append(k) or pack(weights, k))
    params = dict(block.named_parameters())
    x = np.random.default_rng(9).standard_normal((2, 50, HIDDEN)).astype(np.float32)
    assert x.shape[0] * x.shape[1] >= moe_block.COMPACT_MIN_TOKENS

    def run(mode):
        block.experts_mode = mode
        for p in params.values():
            p.requires_grad, p.grad = True, None
        t = vkf.tensor(x, requires_grad=True)
        out = block(t)
        (out * vkf.tensor(np.cos(np.arange(x.size)).reshape(x.shape).astype(np.float32))).sum().backward()
        grads = {name: p.grad.numpy() for name, p in params.items() if p.grad is not None}
        return out.numpy(), t.grad.numpy(), grads

    dense, routed = run("dense"), run("routed" if packed else "listed")
    assert packings == ([2] if packed and block._packable() else [])
    np.testing.assert_allclose(routed[0], dense[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(routed[1], dense[1], rtol=1e-4, atol=1e-5)
    assert routed[2].keys() == dense[2].keys()
    for name in dense[2]:
        np.testing.assert_allclose(routed[2][name], dense[2][name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("fused", [False, True])
def test_routed_experts_in_bfloat16(fused):
    """The routed path in bfloat16 (gathers, row-limited products, scatter) against the dense block in
    bfloat16, to bfloat16 rounding."""
    moe = MoeSpec(EXPERTS, 2, INNER, (True,), **(dict(experts="", fused_experts=(
        "input_linear.weight", "output_linear.weight")) if fused else {}))
    block, arrays = _block(moe)
    block.load_state_dict(arrays, dtype="bfloat16", requires_grad=False)
    x = vkf.tensor(np.random.default_rng(10).standard_normal((100, HIDDEN)).astype(np.float32)).cast("bfloat16")
    results = {}
    for mode in ("routed", "dense"):
        block.experts_mode = mode
        with vkf.no_grad():
            results[mode] = block(x).float().numpy()
    scale = np.abs(results["dense"]).max()
    np.testing.assert_allclose(results["routed"], results["dense"], rtol=0, atol=8e-3 * scale)  # 2^-7: one rounding


def test_experts_output_runs_a_custom_expert_on_the_routed_rows():
    """experts_output(x, weights, run) (DeepSeek-V4's and GLM-5-Next's clipped SwiGLU): run sees each expert's
    list with its live rows, and the result equals the dense form's."""
    moe = MoeSpec(EXPERTS, 2, INNER, (True,))
    block, _ = _block(moe)
    x = vkf.tensor(np.random.default_rng(12).standard_normal((90, HIDDEN)).astype(np.float32))
    weights = block.routing_weights(x)
    seen = []

    def run(expert, rows, live_rows):
        seen.append(live_rows is not None)
        gate, up, down = expert.projections
        return down(gate(rows, live_rows).minimum(0.5) * up(rows, live_rows), live_rows)
    results = {}
    for mode in ("routed", "dense"):
        block.experts_mode = mode
        results[mode] = block.experts_output(x, weights, run).numpy()
    assert seen == [True] * EXPERTS + [False] * EXPERTS
    np.testing.assert_allclose(results["routed"], results["dense"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packed", [True, False])
def test_lora_adapters_on_routed_experts(packed):
    """PEFT-style LoRA on the experts' projections: the adapters run on each expert's routed rows too (packed
    spans or per-expert lists), and the output and the adapters' gradients equal the dense block's."""
    from vkformers.training import LoraConfig, apply_lora
    from vkformers.models.lora import LoraLinear
    block, _ = _block(MoeSpec(EXPERTS, 2, INNER, (True,)))
    apply_lora(block, LoraConfig(r=2, lora_alpha=4, target_modules=["gate_proj", "down_proj"]))
    assert block._packable()
    rng = np.random.default_rng(13)
    for _, module in block.named_modules():
        if isinstance(module, LoraLinear):  # B = 0 at init: give the adapters something to add
            module.lora_B.weight = vkf.parameter(rng.standard_normal(module.lora_B.weight.shape).astype(np.float32))
    adapters = {n: p for n, p in block.named_parameters() if "lora_" in n}
    x = rng.standard_normal((2 * moe_block.COMPACT_MIN_TOKENS, HIDDEN)).astype(np.float32)

    def run(mode):
        block.experts_mode = mode
        for p in adapters.values():
            p.grad = None
        out = block(vkf.tensor(x))
        out.square().sum().backward()
        return out.numpy(), {n: p.grad.numpy() for n, p in adapters.items()}

    (dense, dense_grads), (routed, routed_grads) = run("dense"), run("routed" if packed else "listed")
    np.testing.assert_allclose(routed, dense, rtol=1e-5, atol=1e-5)
    for name in dense_grads:
        np.testing.assert_allclose(routed_grads[name], dense_grads[name], rtol=1e-4, atol=1e-5, err_msg=name)


def _moe_fixtures() -> list[str]:
    from test_decoder_parity import FIXTURES, fixture_names
    from vkformers.models.loading import load_config
    from vkformers.models.plugins import registry
    return [name for name in fixture_names() if registry().resolve(load_config(FIXTURES / name)).family == "moe"]


@pytest.mark.parametrize("name", _moe_fixtures())
def test_routed_experts_match_transformers(monkeypatch, name):
    """Every mixture-of-experts fixture with its experts run on the tokens that chose them (packed, or listed
    where the experts need it) from the first token on: logits and every gradient against transformers, with
    tests/test_decoder_parity.py's tolerances (its own run keeps the fixtures' 16 tokens in place)."""
    import test_decoder_parity as parity
    if parity._unsupported_reason(parity.FIXTURES / name):
        pytest.skip("not implemented (test_decoder_parity says why)")
    monkeypatch.setattr(moe_block, "COMPACT_MIN_TOKENS", 1)
    case = parity.Case(name)  # a run of its own, not the cached one
    parity.check_logits(name, case)
    parity.check_gradients(name, case)


def test_set_experts_mode_sets_every_block_and_drops_the_captured_steps():
    from test_decoder_parity import FIXTURES
    from vkformers import AutoModelForCausalLM
    from vkformers.errors import VkformersError
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / "mixtral")
    ids = np.array([[3, 5, 7, 9]], np.int32)
    routed = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert model._held_decode is not None
    blocks = [m for _, m in model.named_modules() if isinstance(m, SparseMoeBlock)]
    assert moe_block.set_experts_mode(model, "dense") == len(blocks) > 0
    assert {b.experts_mode for b in blocks} == {"dense"} and model._held_decode is None
    np.testing.assert_array_equal(model.generate(ids, max_new_tokens=3, do_sample=False), routed)
    with pytest.raises(VkformersError, match="'sparse' is not one of routed, listed, dense"):
        moe_block.set_experts_mode(model, "sparse")


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="scoring"):
        MoeSpec(EXPERTS, 2, INNER, (True,), scoring="softplus")
    with pytest.raises(ValueError, match="groups"):
        MoeSpec(EXPERTS, 2, INNER, (True,), num_groups=4)
    with pytest.raises(ValueError, match="chooses 2 experts"):
        MoeSpec(EXPERTS, 1, INNER, (True,), scoring="sparsemixer")
    with pytest.raises(ValueError, match="identity experts"):
        MoeSpec(EXPERTS, 2, INNER, (True,), identity_experts=2, num_groups=2)
    with pytest.raises(ValueError, match="gate_up, down"):
        MoeSpec(EXPERTS, 2, INNER, (True,), shared="shared_mlp", shared_size=INNER, shared_fused=True)
    with pytest.raises(ValueError, match="need fused_experts"):
        MoeSpec(EXPERTS, 2, INNER, (True,), swiglu_clip=(1.702, 7.0))
    from vkformers_moe.variants import decoder_spec
    config = dict(model_type="mixtral", vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=4, output_router_logits=True)
    with pytest.raises(UnsupportedConfigError, match="output_router_logits"):
        decoder_spec(config, "mixtral")
    with pytest.raises(UnsupportedConfigError, match="no decoder variant"):
        decoder_spec(dict(config, output_router_logits=False), "no_such_moe")
    mimo = dict(model_type="mimo_v2_flash", vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                head_dim=4, v_head_dim=8)
    with pytest.raises(UnsupportedConfigError, match="v_head_dim"):
        decoder_spec(mimo, "mimo_v2_flash")
    dbrx = dict(model_type="dbrx", vocab_size=16, d_model=8, n_heads=2, n_layers=1,
                ffn_config=dict(moe_normalize_expert_weights=2.0))
    with pytest.raises(UnsupportedConfigError, match="moe_normalize_expert_weights"):
        decoder_spec(dbrx, "dbrx")


def test_claims_are_known_statuses():
    from vkformers_moe.variants import FAMILY, VARIANTS
    assert set(FAMILY.statuses().values()) <= {"verified", "forward-verified"}
    assert set(FAMILY.statuses()) <= set(VARIANTS)  # a claim needs an implementation


def test_axk2_select_keys_keeps_the_k_best_visible():
    from vkformers_moe.axk2 import select_keys
    rng = np.random.default_rng(5)
    scores = rng.standard_normal((2, 6, 6)).astype(np.float32)
    visible = np.tril(np.ones((6, 6), bool))[None] & (np.arange(6) >= np.array([[0], [2]]))[:, None, :]
    keep = select_keys(scores, visible, 3)
    for b in range(2):
        for s in range(6):
            seen = np.flatnonzero(visible[b, s])
            best = seen[np.argsort(-scores[b, s, seen])[:3]]
            np.testing.assert_array_equal(np.flatnonzero(keep[b, s]), np.sort(best))


@pytest.mark.parametrize("name, selecting", [("axk2", 2), ("deepseek_v32", 2), ("glm_moe_dsa", 1)])
def test_dsa_key_selection_changes_the_logits(monkeypatch, name, selecting):
    """The DSA fixtures keep index_topk 4 keys per query of their 8-token rows, so keys are dropped; with the
    selection off (index_topk = the sequence) the logits are no longer transformers' (test_decoder_parity and
    test_generation check them with it on). deepseek_v32 / glm_moe_dsa are aliases of deepseek_v3 whose configs
    select the DSA layer; glm_moe_dsa's layer 1 reuses layer 0's selection (one selecting layer)."""
    from dataclasses import replace
    from pathlib import Path

    import vkformers_moe.axk2 as axk2
    from vkformers.models.loading import AutoModelForCausalLM
    from vkformers.models.safetensors_io import read_safetensors
    folder = Path(__file__).parent / "fixtures" / name
    ref = {k: e.as_float() for k, e in read_safetensors(folder / "reference.safetensors").items()}
    ids, mask = ref["input_ids"].astype(np.int64), ref["attention_mask"].astype(np.int64)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32", requires_grad=False)
    dropped = []
    select = axk2.select_keys
    monkeypatch.setattr(axk2, "select_keys", lambda s, v, k: dropped.append(int((v & ~select(s, v, k)).sum()))
                        or select(s, v, k))
    on = model(ids, attention_mask=mask).logits.numpy()
    assert len(dropped) == selecting and min(dropped) > 0  # every selecting layer drops keys
    assert all(type(layer).__name__ == "Axk2Layer" for layer in model.layers)
    for layer in model.layers:
        layer.options = replace(layer.options, index_topk=ids.shape[1])
    off = model(ids, attention_mask=mask).logits.numpy()
    real = mask.astype(bool)
    np.testing.assert_allclose(on[real], ref["logits"][real], atol=1e-4)
    assert np.abs(off - ref["logits"])[real].max() > 0.1


def test_deepseek_v4_fixture_exercises_its_options():
    """The deepseek_v4 fixture's logits are transformers' (test_decoder_parity), and each option below moves them:
    the CSA indexer's choice (index_topk 2 of up to 4 entries), the Sinkhorn iterations, the sliding window."""
    from dataclasses import replace
    from pathlib import Path

    from vkformers.models.loading import AutoModelForCausalLM
    from vkformers.models.safetensors_io import read_safetensors
    folder = Path(__file__).parent / "fixtures" / "deepseek_v4"
    ref = {k: e.as_float() for k, e in read_safetensors(folder / "reference.safetensors").items()}
    ids, mask = ref["input_ids"].astype(np.int64), ref["attention_mask"].astype(np.int64)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32", requires_grad=False)
    real = mask.astype(bool)
    options = model.spec.make_layer
    for change in (dict(index_topk=8), dict(sinkhorn_iters=1), dict(window=8)):
        for layer in model.layers:
            layer.options = replace(options, **change)
        off = model(ids, attention_mask=mask).logits.numpy()
        assert np.abs(off - ref["logits"])[real].max() > 0.1, change


def test_qwen4_exp_fixture_exercises_its_options():
    """The qwen4_exp_text fixture's logits are transformers' (test_decoder_parity), and each feature below moves them:
    the QSA selection (budget 4 of up to 8 tokens), PLE, its conv and its eos segments, the streams' injection
    weights and input mixing."""
    from dataclasses import replace
    from pathlib import Path

    from vkformers.engine.tensor import Tensor
    from vkformers.models.loading import AutoModelForCausalLM
    from vkformers.models.safetensors_io import read_safetensors
    from vkformers_moe import qwen4_exp
    folder = Path(__file__).parent / "fixtures" / "qwen4_exp_text"
    ref = {k: e.as_float() for k, e in read_safetensors(folder / "reference.safetensors").items()}
    ids, mask = ref["input_ids"].astype(np.int64), ref["attention_mask"].astype(np.int64)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32", requires_grad=False)
    real = mask.astype(bool)
    linear, indexed = model.layers
    ple, options = linear.ple, linear.options

    def moved():
        return np.abs(model(ids, attention_mask=mask).logits.numpy() - ref["logits"])[real].max()

    indexed.options = replace(indexed.options, budget=100)
    assert moved() > 0.1, "selection"
    indexed.options = options
    ple.o = replace(options, eos=-1)
    assert moved() > 0.1, "eos segments"
    ple.o = options
    conv = ple.conv1d.weight
    kept = conv.numpy().copy()
    conv.assign(Tensor(np.zeros_like(kept)))
    assert moved() > 0.1, "PLE conv"
    conv.assign(Tensor(kept))
    object.__setattr__(linear, "ple", None)
    assert moved() > 0.1, "PLE"
    object.__setattr__(linear, "ple", ple)
    inject, forward = qwen4_exp.GatedResidual.inject, qwen4_exp.GatedResidual.forward
    try:
        qwen4_exp.GatedResidual.inject = lambda self, s, out, w: inject(self, s, out, w * 0.0 + 1.0)
        assert moved() > 0.1, "injection weights"
        qwen4_exp.GatedResidual.inject = inject

        def unmixed(self, streams):  # the plain mean of the normed streams
            b, t, _ = streams.shape
            x = self.hc_norm(streams).reshape(b, t, self.n, self.d).mean(2)
            return (x, forward(self, streams)[1]) if self.combine else x
        qwen4_exp.GatedResidual.forward = unmixed
        assert moved() > 0.1, "input mixing"
    finally:
        qwen4_exp.GatedResidual.inject, qwen4_exp.GatedResidual.forward = inject, forward
    assert moved() < 1e-4
    import json

    from vkformers_moe.variants import decoder_spec
    config = json.loads((folder / "config.json").read_text())
    wrapped = AutoModelForCausalLM.from_config(dict(model_type="qwen4_exp", text_config=config))
    assert wrapped.config == config  # the multimodal wrapper builds its text model (core unwraps it)
    with pytest.raises(UnsupportedConfigError, match="output_gate_type"):
        decoder_spec(dict(config, output_gate_type="sigmoid"), "qwen4_exp_text")


def test_dsa_aliases_need_a_q_lora():
    """deepseek_v32 / glm_moe_dsa (aliases of deepseek_v3): the indexer reads the q LoRA, so a config without one
    is refused rather than run without the indexer."""
    import json
    from pathlib import Path

    from vkformers_moe.variants import decoder_spec
    config = json.loads((Path(__file__).parent / "fixtures" / "deepseek_v32" / "config.json").read_text())
    assert decoder_spec(config, "deepseek_v3").make_layer is not None
    with pytest.raises(UnsupportedConfigError, match="q_lora_rank"):
        decoder_spec(dict(config, q_lora_rank=None), "deepseek_v3")
    glm = dict(config, model_type="glm_moe_dsa", indexer_types=["shared", "full"])
    with pytest.raises(UnsupportedConfigError, match="indexer_types"):
        decoder_spec(glm, "deepseek_v3")


@pytest.mark.parametrize("checkpointing", [False, True])
def test_identity_expert_weights_get_gradients_as_transformers_gives_them(checkpointing):
    """LongCat: transformers keeps every expert's projections in one parameter (the identity experts' rows,
    never run, included) and runs it only when a token chose a routed expert. A parameter that runs gets a
    gradient, zeros included (AdamW decays it); one that does not, none (AdamW skips it)."""
    folder = Path(__file__).parent / "fixtures" / "longcat_flash"
    ids = np.array([[5, 9, 3, 17, 22, 4]])

    def expert_grads(identity_only: bool):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32")
        if checkpointing:
            model.gradient_checkpointing_enable()
        for _, block in model.named_modules():
            if isinstance(block, SparseMoeBlock) and identity_only:  # the identity experts always win the choice
                bias = np.zeros(block.selection_bias.shape, np.float32)
                bias[block.moe.num_experts:] = 1e3
                block.selection_bias = vkf.tensor(bias)
        model(ids, labels=ids).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if ".mlp.experts." in n}

    chosen = expert_grads(identity_only=False)
    assert chosen and all(g is not None for g in chosen.values())
    unused = [n for n in chosen if ".experts.4." in n or ".experts.5." in n]
    assert unused and all(not chosen[n].numpy().any() for n in unused)
    assert all(g is None for g in expert_grads(identity_only=True).values())


def test_kimi_linear_reads_released_dense_mlp_names(tmp_path):
    """Released Kimi Linear checkpoints keep dense MLPs under ``mlp.*``; transformers saves them (and the fixture
    holds them) under ``block_sparse_moe.*``: both load into the same model, with the fixture's logits."""
    import json
    import shutil

    from vkformers.models.safetensors_io import read_safetensors
    from safetensors.numpy import load_file, save_file
    folder = Path(__file__).parent / "fixtures" / "kimi_linear"
    ref = {k: e.as_float() for k, e in read_safetensors(folder / "reference.safetensors").items()}
    ids, mask = ref["input_ids"].astype(np.int64), ref["attention_mask"].astype(np.int64)
    weights = load_file(str(folder / "model.safetensors"))
    dense = "model.layers.0.block_sparse_moe."
    assert f"{dense}gate_proj.weight" in weights
    save_file({k.replace(dense, "model.layers.0.mlp."): v for k, v in weights.items()},
              str(tmp_path / "model.safetensors"))
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    assert json.loads((tmp_path / "config.json").read_text())["mlp_layer_types"][0] == "dense"
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype="float32", requires_grad=False)
    logits = model(ids, attention_mask=mask).logits.numpy()
    real = mask.astype(bool)
    np.testing.assert_allclose(logits[real], ref["logits"][real], atol=1e-4)
