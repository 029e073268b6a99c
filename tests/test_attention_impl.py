"""The attention entry point (kernels/attention.py) and GenerationConfig(attention=...):
every implementation against the jnp reference, op by op and through `generate`."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maskahead_jax as mj
from maskahead_jax import quant
from maskahead_jax.kernels import attention, quant_reference, reference
from maskahead_jax.policies import make

from tiny import tiny_model


def _operands(b=2, hkv=2, g=3, t=8, s=40, d=16, seed=0, dtype=jnp.float32):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = jax.random.normal(ks[0], (b, hkv, g, t, d), dtype)
    kc = jax.random.normal(ks[1], (b, hkv, s, d), dtype)
    vc = jax.random.normal(ks[2], (b, hkv, s, d), dtype)
    valid = jax.random.bernoulli(ks[3], 0.7, (b, hkv, s)).at[..., 0].set(True)  # per-head holes
    kb = jax.random.normal(ks[4], (b, hkv, t, d), dtype)
    vb = jax.random.normal(ks[5], (b, hkv, t, d), dtype)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    blk = pos[:, None, :] // 4 <= pos[:, :, None] // 4  # block-causal inside the block
    rows = jnp.zeros((b, t), bool).at[:, 2:].set(True)
    return q, kc, vc, valid, kb, vb, blk, rows


def _kernels_and_reference(model, prompts, base: dict, pol, impl: str = "pallas_tpu"):
    """generate through the kernels of `impl` (interpret mode) and through the reference; the
    tokens must be identical. Returns (kernels output, reference output)."""
    want = mj.generate(model, prompts, mj.GenerationConfig(attention="reference", **base), pol)
    got = mj.generate(model, prompts, mj.GenerationConfig(attention=impl, attention_interpret=True,
                                                          **base), pol)
    for a, b in zip(got.tokens, want.tokens):
        assert list(a) == list(b)
    return got, want


def test_resolve_names_and_errors():
    assert attention.resolve("auto", backend="cpu") == "reference"
    assert attention.resolve("auto", backend="gpu") == "pallas_gpu"
    assert attention.resolve("kernels", backend="tpu") == "pallas_tpu"
    assert attention.resolve("pallas_tpu", backend="cpu") == "pallas_tpu"
    with pytest.raises(ValueError, match="no kernels for the 'cpu' backend"):
        attention.resolve("kernels", backend="cpu")
    with pytest.raises(ValueError, match="unknown attention implementation 'flash'"):
        attention.resolve("flash")


def test_default_outside_any_scope_is_the_reference():
    assert attention.current().impl == "reference"
    with attention.use("pallas_tpu", interpret=True):
        assert attention.current() == attention.Choice("pallas_tpu", True, False)
    assert attention.current().impl == "reference"


def test_fused_block_attention_matches_reference():
    q, _, _, _, kb, vb, blk, _ = _operands()
    want, _ = reference.attention(q, None, None, None, kb, vb, blk)
    got = attention.fused_block_attention(q, kb, vb, blk)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("with_stats", [False, True])
def test_attend_tpu_kernel_float_context_matches_reference(with_stats):
    q, kc, vc, valid, kb, vb, blk, rows = _operands()
    rows = rows if with_stats else None
    want_out, want_stats = reference.attention(q, kc, vc, valid, kb, vb, blk, rows)
    with attention.use("pallas_tpu", interpret=True):
        out, stats = attention.attend(q, (kc, vc, valid), kb, vb, blk, rows)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), atol=2e-4, rtol=2e-4)
    if with_stats:
        np.testing.assert_allclose(np.asarray(stats.mass), np.asarray(want_stats.mass), atol=1e-5)
        np.testing.assert_allclose(np.asarray(stats.score), np.asarray(want_stats.score), atol=1e-4)
    else:
        assert stats is None


@pytest.mark.parametrize("bits", [4, 2])
def test_attend_tpu_kernel_packed_context_matches_reference(bits):
    q, kc, vc, _, kb, vb, blk, rows = _operands(s=64, d=32)
    ctx = quant.quantize_kv(kc, vc, bits)
    valid = jnp.ones(kc.shape[:3], bool).at[:, 1, 5:9].set(False)
    want_out, want_stats = quant_reference.attention_quant(q, ctx, valid, kb, vb, blk, rows)
    with attention.use("pallas_tpu", interpret=True):
        out, stats = attention.attend(q, (ctx, None, valid), kb, vb, blk, rows)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(np.asarray(stats.mass), np.asarray(want_stats.mass), atol=1e-5)


def test_max_pooled_statistics_by_hand_and_through_any_implementation():
    """pool="max": each key's mass is the largest prefix-softmax probability a selected row (and
    query head) gives it, by hand in numpy; `attend(..., pool="max")` computes exactly that
    whatever implementation is chosen (the TPU kernels here, the reference), float and packed."""
    q, kc, vc, valid, kb, vb, blk, rows = _operands(s=64, d=32)
    lg = np.einsum("bhgtd,bhsd->bhgts", np.asarray(q), np.asarray(kc)) / np.sqrt(q.shape[-1])
    lg = np.where(np.asarray(valid)[:, :, None, None], lg, -np.inf)
    p = np.exp(lg - lg.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = (p * np.asarray(rows)[:, None, None, :, None]).max(axis=(2, 3))
    out_mean, mean = reference.attention(q, kc, vc, valid, kb, vb, blk, rows)
    _, stats = reference.attention(q, kc, vc, valid, kb, vb, blk, rows, pool="max")
    np.testing.assert_allclose(np.asarray(stats.mass), want, atol=1e-6)
    _, both = reference.attention(q, kc, vc, valid, kb, vb, blk, rows, pool="mean+max")
    np.testing.assert_allclose(np.asarray(both.mass), np.asarray(mean.mass) + want / want.sum(-1, keepdims=True),
                               atol=1e-6)
    # max_joint: the same max over the joint softmax of [context | block] (the block's keys dilute it)
    lb = np.einsum("bhgtd,bhsd->bhgts", np.asarray(q), np.asarray(kb)) / np.sqrt(q.shape[-1])
    lb = np.where(np.asarray(blk)[:, None, None], lb, -np.inf)
    full = np.concatenate([lg, lb], -1)
    pj = np.exp(full - full.max(-1, keepdims=True))
    pj = (pj / pj.sum(-1, keepdims=True))[..., :lg.shape[-1]]
    _, joint = reference.attention(q, kc, vc, valid, kb, vb, blk, rows, pool="max_joint")
    np.testing.assert_allclose(np.asarray(joint.mass), (pj * np.asarray(rows)[:, None, None, :, None]).max(axis=(2, 3)),
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(stats.score), np.asarray(reference.value_score(stats.mass, vc)),
                               rtol=1e-6)
    with attention.use("pallas_tpu", interpret=True):
        out, got = attention.attend(q, (kc, vc, valid), kb, vb, blk, rows, pool="max")
    np.testing.assert_allclose(np.asarray(got.mass), want, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_mean), atol=1e-6)  # the output is pooling-free
    packed = quant.quantize_kv(kc, vc, 4)
    _, want_q = quant_reference.attention_quant(q, packed, valid, kb, vb, blk, rows, pool="max")
    _, got_q = attention.attend(q, (packed, None, valid), kb, vb, blk, rows, pool="max")
    np.testing.assert_allclose(np.asarray(got_q.mass), np.asarray(want_q.mass), atol=1e-6)
    # "pallas_gpu" (Mosaic GPU, whose pass 2 pools by the mean) pools by mean + max on Triton's
    _, want_b = quant_reference.attention_quant(q, packed, valid, kb, vb, blk, rows, pool="mean+max")
    with attention.use("pallas_gpu", interpret=True):
        _, got_b = attention.attend(q, (packed, None, valid), kb, vb, blk, rows, pool="mean+max")
    np.testing.assert_allclose(np.asarray(got_b.mass), np.asarray(want_b.mass), atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_b.score), np.asarray(want_b.score), atol=1e-5)
    with pytest.raises(ValueError, match="pool must be one of"):
        attention.attend(q, (kc, vc, valid), kb, vb, blk, rows, pool="sum")


@pytest.mark.parametrize("policy", ["dense", "maskahead-qa"])
def test_generate_with_kernels_matches_reference(policy, monkeypatch):
    """The whole engine (prefill chunks, step-0 scoring, eviction, selection, commit forwards)
    with every attention through the TPU kernels in interpret mode: the same tokens. maskahead-qa
    (MaskAhead's selection and eviction, bounded prefill, the question probes) pools its question
    rows by mean + max (q-maskahead-draft's pooling): those probes take the kernels' pooled
    statistics (on a GPU, the Triton kernels': test_max_pooled_statistics_...)."""
    traced = []
    real = attention.dispatch.scored_attention

    def spy(*a, **kw):
        traced.append((kw["impl"], a[-1] is not None if len(a) > 7 else False, kw.get("pool")))
        return real(*a, **kw)

    monkeypatch.setattr(attention.dispatch, "scored_attention", spy)
    model = tiny_model("sdar", scale=0.5, max_position_embeddings=4000 + len(policy))  # a fresh trace
    prompts = [list(range(1, 30)), list(range(3, 20))]
    pol = None if policy == "dense" else make(
        "maskahead-qa", capacity_pct=50, capacity_floor=8, topk_floor=4, recent=4, sinks=1,
        question_tokens=8, question_pool="mean+max", interval_blocks=1, lookahead_blocks=2)
    # 4 denoising steps per 8-token block (not 8): the same paths, half the interpret-mode calls
    base = dict(max_new_tokens=16, prefill_chunk=16, stop_at_eos=False, steps_per_block=4)
    got, want = _kernels_and_reference(model, prompts, base, pol)
    assert got.stats["nfe"] == want.stats["nfe"]
    assert traced and {i for i, _, _ in traced} == {"pallas_tpu"}  # the kernel path was traced
    if pol is not None:
        assert got.stats["evictions"] == want.stats["evictions"] > 0
        assert any(stats and p == "mean" for _, stats, p in traced)  # step-0 scoring: pass 2
        assert any(stats and p == "mean+max" for _, stats, p in traced)  # the question probes


def test_generate_auto_on_cpu_is_the_reference_and_kernels_is_an_error():
    model = tiny_model("sdar")
    gen = dict(max_new_tokens=8, stop_at_eos=False)
    a = mj.generate(model, [[1, 2, 3]], mj.GenerationConfig(**gen))
    b = mj.generate(model, [[1, 2, 3]], mj.GenerationConfig(attention="reference", **gen))
    assert list(a.tokens[0]) == list(b.tokens[0])
    with pytest.raises(ValueError, match="no kernels for the 'cpu' backend"):
        mj.generate(model, [[1, 2, 3]], mj.GenerationConfig(attention="kernels", **gen))


def test_generate_q_maskahead_with_packed_kernels_matches_reference():
    """Q-MaskAhead's packed int4 cache read by the kernel (codes dequantized tile by tile)."""
    model = tiny_model("sdar", scale=0.5, head_dim=32, block_size=32, max_position_embeddings=4093)
    prompts = [list(range(1, 40)) * 2, list(range(3, 40))]
    pol = make("q-maskahead", capacity_pct=50, capacity_floor=32, topk_floor=8, recent=8, sinks=1)
    base = dict(max_new_tokens=32, prefill_chunk=32, stop_at_eos=False, steps_per_block=8)  # 8 steps, not 32
    got, want = _kernels_and_reference(model, prompts, base, pol)
    assert got.stats["kv_bytes_final"] == want.stats["kv_bytes_final"]
    assert got.stats["evictions"] == want.stats["evictions"] > 0


@pytest.mark.parametrize("policy", ["dense", "maskkv"])
def test_generate_bidirectional_with_kernels_matches_reference(policy):
    """Dream-style: the full [prompt | response] forward through dot_product_attention (no
    context), the response steps and MaskKV's vote over the prompt cache through the kernel."""
    model = tiny_model("dream", scale=0.5, max_position_embeddings=4090 + len(policy))
    prompts = [list(range(1, 30)), list(range(3, 20))]
    pol = None if policy == "dense" else make("maskkv", kv_entries=8)
    base = dict(max_new_tokens=16, block_size=8, steps_per_block=4, stop_at_eos=False)
    _kernels_and_reference(model, prompts, base, pol)


def test_a_named_kernel_is_accepted_under_a_mesh():
    """Under a mesh the kernels run per shard (kernels/sharded.py; tests/test_sharding.py runs
    them on 8 devices), so neither "auto" nor a named kernel is refused or replaced."""
    from maskahead_jax.engine.generate import _attention_for
    for name in ("auto", "pallas_tpu"):
        gen = mj.GenerationConfig(attention=name).resolve(tiny_model("sdar").config)
        assert _attention_for(gen, mesh=object()) == gen
    with pytest.raises(ValueError, match="unknown attention"):
        _attention_for(mj.GenerationConfig(attention="flash").resolve(tiny_model("sdar").config), mesh=None)