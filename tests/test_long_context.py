"""Long passes in O(T) memory: the chunked online-softmax attention against the one-softmax
reference, position masks against the booleans they stand for, whole forwards and generations
with chunking forced against the default path, and no [T, T] array in a traced long pass."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maskahead_jax.engine.generate import lower
from maskahead_jax.generate import generate
from maskahead_jax.config import GenerationConfig
from maskahead_jax.kernels import masks, reference
from maskahead_jax.model import forward_logits
from maskahead_jax.policies import make
from experiments.check_long_programs import long_intermediates as _big_shapes, trace_core
from tiny import BIDIRECTIONAL, tiny_model


def _inputs(seed, b=2, hkv=2, g=2, t=37, s=53, d=8, dtype=jnp.float32):
    r = np.random.RandomState(seed)
    f = lambda *sh: jnp.asarray(r.randn(*sh), dtype)
    valid = jnp.asarray(r.rand(b, hkv, s) < 0.7)
    valid = valid.at[1, 1, 30:].set(False)  # a lane whose tail is empty (the live-chunk bound)
    rows = jnp.asarray(r.rand(b, t) < 0.5)
    pos = jnp.asarray(np.sort(r.choice(200, size=(b, t)), axis=1), jnp.int32)
    kvalid = jnp.asarray(r.rand(b, t) < 0.8)
    return f(b, hkv, g, t, d), f(b, hkv, s, d), f(b, hkv, s, d), valid, f(b, hkv, t, d), f(b, hkv, t, d), \
        rows, pos, kvalid


@pytest.mark.parametrize("pool", reference.POOLS)
@pytest.mark.parametrize("block_size", [0, 8])
def test_chunked_equals_one_softmax_with_context_and_stats(pool, block_size):
    q, kc, vc, valid, kb, vb, rows, pos, kvalid = _inputs(0)
    pm = masks.PositionMask(pos, pos, kvalid, block_size)
    want_out, want = reference.attention(q, kc, vc, valid, kb, vb, pm.dense(), rows, pool)
    for qc, kcnk in [(8, 16), (5, 7), (64, 64)]:
        out, got = reference.attention_chunked(q, kc, vc, valid, kb, vb, pm, rows, pool, qc, kcnk)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), atol=2e-6)
        np.testing.assert_allclose(np.asarray(got.mass), np.asarray(want.mass), atol=2e-6)
        np.testing.assert_allclose(np.asarray(got.score), np.asarray(want.score), atol=2e-6)
    # a dense boolean block mask takes the same path
    out, got = reference.attention_chunked(q, kc, vc, valid, kb, vb, pm.dense(), rows, pool, 8, 16)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), atol=2e-6)
    np.testing.assert_allclose(np.asarray(got.mass), np.asarray(want.mass), atol=2e-6)


def test_chunked_without_context_and_in_bfloat16():
    q, _, _, _, kb, vb, _, pos, kvalid = _inputs(1)
    pm = masks.PositionMask(pos, pos, kvalid, 0)
    want, _ = reference.attention(q, None, None, None, kb, vb, pm.dense())
    got, stats = reference.attention_chunked(q, None, None, None, kb, vb, pm, None, "mean", 8, 8)
    assert stats is None
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)
    bf = lambda x: x.astype(jnp.bfloat16)
    want, _ = reference.attention(bf(q), None, None, None, bf(kb), bf(vb), pm.dense())
    got, _ = reference.attention_chunked(bf(q), None, None, None, bf(kb), bf(vb), pm, None, "mean", 8, 8)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=3e-2)


def test_position_mask_tiles_and_validation():
    pos = jnp.asarray([[0, 1, 5, 8, 9, 17]], jnp.int32)
    kv = jnp.asarray([[True, True, False, True, True, True]])
    bc = masks.block_causal(pos, 8, kv).dense()[0]
    want = (np.asarray(pos[0])[None, :] // 8 <= np.asarray(pos[0])[:, None] // 8) & np.asarray(kv[0])[None]
    np.testing.assert_array_equal(np.asarray(bc), want)
    assert masks.bidirectional(pos, kv).shape == (1, 6, 6)
    np.testing.assert_array_equal(np.asarray(masks.bidirectional(pos, kv).dense()[0]),
                                  np.broadcast_to(np.asarray(kv[0]), (6, 6)))
    with pytest.raises(ValueError, match="block_size"):
        masks.PositionMask(pos, pos, None, -1)
    with pytest.raises(ValueError, match="chunk"):
        with reference.chunking(q=0):
            pass


@pytest.mark.parametrize("family,attention", [("sdar", "block_causal"), ("llada", "bidirectional")])
def test_forward_chunked_equals_default(family, attention):
    m = tiny_model(family)
    toks = jnp.asarray(np.random.RandomState(2).randint(0, 40, size=(2, 45)), jnp.int32)
    want = forward_logits(m.params, m.config, toks, attention=attention)
    with reference.chunking(q=8, k=16, min_elems=0):
        got = jax.jit(lambda p, x: forward_logits(p, m.config, x, attention=attention))(m.params, toks)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)


@pytest.mark.parametrize("family", BIDIRECTIONAL)
@pytest.mark.parametrize("policy", [None, "maskkv"])
def test_bidirectional_generate_chunked_gives_the_same_tokens(family, policy):
    m = tiny_model(family)
    prompts = [list(range(1, 30)), list(range(3, 20))]
    gen = GenerationConfig(max_new_tokens=16, block_size=8, threshold=0.9)
    pol = None if policy is None else make(policy, 25)
    want = generate(m, prompts, gen, policy=pol)
    jax.clear_caches()
    with reference.chunking(q=8, k=8, min_elems=0):
        got = generate(m, prompts, gen, policy=pol)
    jax.clear_caches()
    assert got.tokens == want.tokens


@pytest.mark.parametrize("family", ["sdar", "llada"])
def test_no_t_by_t_array_in_a_long_forward(family):
    m = tiny_model(family)
    t = 4096
    toks = jnp.zeros((1, t), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p, x: forward_logits(p, m.config, x))(m.params, toks)
    assert _big_shapes(jaxpr.jaxpr, t) == []
    # the short path does materialise it: the check sees such arrays when they exist
    with reference.chunking(min_elems=1 << 40):
        jaxpr = jax.make_jaxpr(lambda p, x: forward_logits(p, m.config, x))(m.params, toks)
    assert _big_shapes(jaxpr.jaxpr, t)


@pytest.mark.parametrize("name,kw", [("maskkv", {}), ("maskkv", dict(budget_per_head=6, budget_pct=None)),
                                     ("pyramidkv", {}), ("adakv", {})])
def test_maskkv_layer_by_layer_equals_online(name, kw):
    """The cut made inside the full pass, layer by layer, keeps the same entries and gives the
    same tokens as the online variant (full pass, vote forward, cut); its peak is lower."""
    m = tiny_model("llada")
    prompts = [list(range(1, 40)), list(range(3, 25))]
    gen = GenerationConfig(max_new_tokens=16, block_size=8, threshold=0.9)
    lw = make(name, 20, **kw)
    online = make(name, 20, layerwise=False, **kw)
    assert lw.prompt_layerwise and not online.prompt_layerwise
    a, b = generate(m, prompts, gen, policy=lw), generate(m, prompts, gen, policy=online)
    assert a.tokens == b.tokens
    np.testing.assert_array_equal(np.asarray(a.stats["kv_bytes_final"]), np.asarray(b.stats["kv_bytes_final"]))
    assert np.all(np.asarray(a.stats["kv_bytes_peak"]) < np.asarray(b.stats["kv_bytes_peak"]))
    assert a.stats["nfe"][0] == b.stats["nfe"][0] - 1  # no separate vote forward


@pytest.mark.parametrize("family,policy", [("sdar", None), ("sdar", "maskahead"), ("sdar", "q-maskahead"),
                                           ("llada", None), ("llada", "maskkv"), ("llada", "maskkv-online")])
def test_no_t_by_t_array_in_a_long_generate(family, policy):
    """The whole generate program at a 4096-token prompt (traced, not run) holds no
    intermediate with two axes of the prompt's length: prefill, refresh, votes, statistics."""
    from maskahead_jax.policies import Dense

    m = tiny_model(family, max_position_embeddings=8192, head_dim=32)  # packed caches: 32-wide groups
    t = 4096
    gen = GenerationConfig(max_new_tokens=32, block_size=32, prefill_chunk=512).resolve(m.config)
    pol = make(policy, 10) if policy else Dense()
    jaxpr = trace_core(m, pol, t, gen)
    assert _big_shapes(jaxpr.jaxpr, t) == []


@pytest.mark.parametrize("family", ["sdar", "llada"])
def test_nonfinite_logits_stop_the_run(family):
    """One NaN weight: generate raises a clear error instead of returning mask ids as answers."""
    from maskahead_jax.api import Model
    from maskahead_jax.engine.stats import NonFiniteLogitsError

    m = tiny_model(family)
    params = jax.tree_util.tree_map(lambda a: a, m.params)
    params["layers"]["wv"] = params["layers"]["wv"].at[0, 0, 0, 0].set(jnp.nan)
    bad = Model(m.config, params)
    gen = GenerationConfig(max_new_tokens=8, block_size=8)
    assert generate(m, [list(range(1, 12))], gen).tokens  # the healthy model runs
    with pytest.raises(NonFiniteLogitsError, match="NaN / inf logits"):
        generate(bad, [list(range(1, 12))], gen)


@pytest.mark.parametrize("family,policy", [("sdar", None), ("sdar", "maskahead"), ("llada", "maskkv"),
                                           ("llada", "maskkv-online")])
def test_prefill_then_decode_programs_equal_the_whole_program(family, policy):
    """The benchmarks time the decode alone (experiments/bench_long_context.py): the prefill
    program's `state` fed to the decode program gives the whole program's tokens and KV."""
    m = tiny_model(family)
    prompts = [list(range(1, 40)), list(range(3, 25))]
    gen = GenerationConfig(max_new_tokens=16, block_size=8, threshold=0.9)
    pol = None if policy is None else make(policy, 25)
    whole, args = lower(m, prompts, gen, pol)
    want = whole.compile()(*args)
    pre, args = lower(m, prompts, gen, pol, phase="prefill")
    state = pre.compile()(*args)["state"]
    dec, args = lower(m, prompts, gen, pol, phase="decode", prefilled=state)
    got = dec.compile()(*args)
    for k in ("out", "kv_bytes", "kv_peak", "nfe"):
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
    with pytest.raises(ValueError, match="prefilled"):
        lower(m, prompts, gen, pol, phase="decode")
