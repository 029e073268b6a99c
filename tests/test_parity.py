"""Logit parity of the Flax model, loaded through the converters, against transformers' torch classes.

Families: Qwen2 (Fast-dLLM v2 / Dream keys), Qwen3 (SDAR / DreamReasoner keys), Llama renamed
into LLaDA-8B's keys, Glm4Moe renamed and fused into LLaDA2.0-mini's keys; each under the
bidirectional and the block-causal mask (a 4D additive mask on the torch side).

Bounds: float32 max |dlogit| <= 1e-4. bfloat16 (weights rounded the same way on both sides)
max |dlogit| <= 0.25 with logits of magnitude ~4; torch's own bf16-vs-fp32 gap is ~0.1. bf16
noise flips near-tied expert choices (torch's own bf16 run does so too), so the MoE's bf16 run
uses a model whose expert biases make the selection input-independent (`static_routing`); the
float32 runs cover input-dependent, group-limited selection.

The LLaDA2 tests at the end pin where the published LLaDA2.0 modeling code differs from
transformers' Glm4Moe; the Flax model follows LLaDA2.
"""
from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hf_fixtures as hf  # noqa: E402
import maskahead_jax as mj  # noqa: E402
from maskahead_jax.config import ModelConfig  # noqa: E402
from maskahead_jax.model import apply_rope, moe_mlp, route, rope_tables  # noqa: E402

FAMILIES = ["qwen2", "qwen3", "llada", "llada2"]
KINDS = ["bidirectional", "block_causal"]
FP32_TOL, BF16_TOL = 1e-4, 0.25


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    out = {f: hf.BUILDERS[f](str(tmp_path_factory.mktemp(f)), seed=i) for i, f in enumerate(FAMILIES)}
    out["llada2_static"] = hf.llada2(str(tmp_path_factory.mktemp("llada2_static")), seed=7,
                                     static_routing=True)
    return out


def _tokens(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, hf.VOCAB, (2, 8))


def _load(case, dtype) -> mj.Model:
    m = mj.load_pretrained(case.path, dtype=dtype)
    return mj.Model(m.config.replace(block_size=hf.BLOCK), m.params)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_float32(cases, family, kind):
    case = cases[family]
    toks = _tokens()
    ref = hf.torch_logits(case.model, toks, kind)
    got = np.asarray(mj.forward(_load(case, "float32"), toks, attention=kind))
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= FP32_TOL


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_bfloat16(cases, family, kind):
    case = cases["llada2_static" if family == "llada2" else family]
    toks = _tokens(1)
    ref = hf.torch_logits(copy.deepcopy(case.model).to(torch.bfloat16), toks, kind)
    model = _load(case, "bfloat16")
    assert {l.dtype for l in jax.tree_util.tree_leaves(model.params)} == {jnp.dtype(jnp.bfloat16)}
    got = np.asarray(mj.forward(model, toks, attention=kind))
    assert np.abs(got - ref).max() <= BF16_TOL


def test_masks_differ_and_defaults(cases):
    """The two masks give different logits (so both are really exercised); family defaults."""
    fams = {f: _load(cases[f], "float32") for f in FAMILIES}
    toks = _tokens()
    for m in fams.values():
        a = np.asarray(mj.forward(m, toks, attention="bidirectional"))
        b = np.asarray(mj.forward(m, toks, attention="block_causal"))
        assert np.abs(a - b).max() > 1e-2
    assert [fams[f].config.family for f in FAMILIES] == ["fast_dllm_v2", "sdar", "llada", "llada2"]
    c = fams["llada2"].config
    assert (c.rope_dim, c.head_dim, c.num_dense_mlp_layers, c.qk_norm) == (8, 16, 1, True)
    assert fams["qwen2"].config.qkv_bias and fams["qwen3"].config.qk_norm


def test_llada2_router_bias_is_loaded_and_used(cases):
    """expert_bias changes routing: zeroing it must change the logits (the test would miss it otherwise)."""
    m = _load(cases["llada2"], "float32")
    bias = np.asarray(m.params["moe_layers"]["moe"]["router_bias"])
    ref = cases["llada2"].model.model.layers[1].mlp.gate.e_score_correction_bias.detach().numpy()
    np.testing.assert_array_equal(bias[0], ref)
    params = jax.tree_util.tree_map(lambda a: a, m.params)
    params["moe_layers"]["moe"]["router_bias"] = jnp.zeros_like(params["moe_layers"]["moe"]["router_bias"])
    toks = _tokens()
    a = np.asarray(mj.forward(m, toks))
    b = np.asarray(mj.forward(mj.Model(m.config, params), toks))
    assert np.abs(a - b).max() > 1e-2


# ------------------------------------------------------------------ LLaDA2 vs Glm4Moe

def _moe_cfg(**kw) -> ModelConfig:
    base = dict(family="llada2", layout="llada2", vocab_size=8, hidden_size=8, num_layers=2, num_heads=1,
                num_kv_heads=1, head_dim=8, intermediate_size=8, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=1, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    base.update(kw)
    return ModelConfig(**base)


def _logit(p):
    p = np.asarray(p, np.float64)
    return np.log(p / (1 - p))


def test_route_hand_computed_group_limited():
    """Group score = sum of the top-2 *biased* scores; bias only selects; weights are the raw
    sigmoid scores of the chosen experts, normalised, times routed_scaling_factor (both codes agree)."""
    cfg = _moe_cfg()
    s = np.array([0.95, 0.05, 0.62, 0.58, 0.55, 0.53, 0.30, 0.30])  # groups {0,1} {2,3} {4,5} {6,7}
    bias = np.array([0, 0, 0, 0, 0.2, 0, 0, 0])
    # biased group scores: 1.00, 1.20, 1.28, 0.60 -> groups 2 and 1 (a max-per-group rule would keep
    # group 0 for expert 0's 0.95); inside them biased scores 0.62, 0.58, 0.75, 0.53 -> experts 4, 2.
    p = {"router": jnp.eye(8, dtype=jnp.float32), "router_bias": jnp.asarray(bias, jnp.float32)}
    idx, w = route(p, jnp.asarray(_logit(s)[None], jnp.float32), cfg)
    idx, w = np.asarray(idx)[0], np.asarray(w)[0]
    order = np.argsort(idx)
    np.testing.assert_array_equal(idx[order], [2, 4])
    np.testing.assert_allclose(w[order], 2.5 * np.array([0.62, 0.55]) / 1.17, rtol=1e-6)


def test_route_top1_is_not_normalised():
    """LLaDA2's gate normalises only when top_k > 1 (and never reads norm_topk_prob); Glm4Moe with
    norm_topk_prob=True would return weight 1 * scale here."""
    cfg = _moe_cfg(num_experts_per_tok=1, n_group=1, topk_group=1, norm_topk_prob=True)
    s = np.array([0.2, 0.7, 0.1, 0.3, 0.4, 0.2, 0.6, 0.5])
    p = {"router": jnp.eye(8, dtype=jnp.float32), "router_bias": jnp.zeros(8, jnp.float32)}
    idx, w = route(p, jnp.asarray(_logit(s)[None], jnp.float32), cfg)
    assert int(idx[0, 0]) == 1
    np.testing.assert_allclose(float(w[0, 0]), 2.5 * 0.7, rtol=1e-6)


def test_moe_combines_experts_in_float32():
    """LLaDA2's moe_infer sums weight * expert output over the k experts in float32 and rounds once
    to the model dtype (Glm4Moe rounds each expert's contribution to bf16 before adding)."""
    bf16 = ml_dtypes.bfloat16
    cfg = _moe_cfg(hidden_size=4, num_experts=2, n_group=1, topk_group=1)
    c = np.array([[3.375, 2.5625, 2.0625, 1.0625], [1.25, 0.1875, 0.3125, 0.125]])
    gate = np.zeros((2, 4, 1)); gate[:, 0, 0] = 20.0  # silu(20) == 20 in bf16
    up = np.zeros((2, 4, 1)); up[:, 0, 0] = 1.0
    router = np.zeros((4, 2)); router[0] = [0.3, -0.2]
    p = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.bfloat16), {
        "router": router, "router_bias": np.zeros(2),
        "experts": {"gate": gate, "up": up, "down": c[:, None, :]}})
    x = jnp.zeros((1, 1, 4), jnp.bfloat16).at[0, 0, 0].set(1.0)
    idx, w = route(p, x.reshape(1, 4), cfg)
    y = (20.0 * c).astype(np.float32)[np.asarray(idx)[0]]  # exact in bf16
    w = np.asarray(w)[0]
    llada2 = (w[0] * y[0] + w[1] * y[1]).astype(bf16)
    per_expert = sum((yi.astype(bf16) * wi.astype(bf16)).astype(np.float32) for yi, wi in zip(y, w)).astype(bf16)
    assert (llada2 != per_expert).any()  # the example separates the two orders
    np.testing.assert_array_equal(np.asarray(moe_mlp(p, x, cfg))[0, 0], llada2)


def test_partial_rope_is_rotate_half_on_leading_dims():
    """LLaDA2 and Glm4Moe both rotate the first rotary_dim dims NeoX-style (pairs j, j + rot/2) and
    pass the rest through (no interleaving as in GLM-4's dense model)."""
    rot, d, theta = 4, 8, 600000.0
    x = np.random.default_rng(0).normal(size=(1, 3, 1, d)).astype(np.float32)
    pos = np.arange(3)[None]
    cos, sin = rope_tables(jnp.asarray(pos), rot, theta)
    got = np.asarray(apply_rope(jnp.asarray(x), cos, sin))
    inv = theta ** (-np.arange(0, rot, 2) / rot)
    ang = pos[0][:, None] * inv  # [T, rot/2]
    want = x.copy()
    for j in range(rot // 2):
        a, b = x[0, :, 0, j], x[0, :, 0, j + rot // 2]
        want[0, :, 0, j] = a * np.cos(ang[:, j]) - b * np.sin(ang[:, j])
        want[0, :, 0, j + rot // 2] = b * np.cos(ang[:, j]) + a * np.sin(ang[:, j])
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_array_equal(got[..., rot:], x[..., rot:])


def test_llada2_router_takes_the_model_dtype(cases):
    """Glm4Moe keeps gate.weight / the score bias in fp32 under a bf16 load; LLaDA2 casts them with
    the model (and upcasts inside the gate). The converter follows LLaDA2."""
    moe = _load(cases["llada2"], "bfloat16").params["moe_layers"]["moe"]
    assert moe["router"].dtype == jnp.bfloat16 and moe["router_bias"].dtype == jnp.bfloat16
