"""The pure-function model: cached forward == full forward; masks; public forward()."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maskahead_jax
from maskahead_jax import cache as kvc
from maskahead_jax.model import Segment, forward_logits, full_mask, lm_head, model_step
from tiny import BLOCK_CAUSAL, tiny_model


@pytest.mark.parametrize("family", BLOCK_CAUSAL)
def test_cached_block_equals_full_forward(family):
    m = tiny_model(family)
    cfg, bs = m.config, m.config.block_size
    toks = jnp.asarray(np.random.RandomState(0).randint(0, 40, size=(2, 3 * bs)), jnp.int32)
    full = forward_logits(m.params, cfg, toks, attention="block_causal")
    # prefix (2 blocks) into a cache, then the last block against [cache | block]
    pos = jnp.broadcast_to(jnp.arange(3 * bs, dtype=jnp.int32), toks.shape)
    pre = model_step(m.params, cfg, toks[:, :2 * bs], pos[:, :2 * bs],
                     full_mask(pos[:, :2 * bs], "block_causal", bs), [Segment(0, cfg.num_layers, None)])
    c = kvc.empty(cfg.num_layers, 2, cfg.num_kv_heads, 4 * bs, cfg.head_dim, jnp.float32)
    c = kvc.append(c, pre.k, pre.v, pos[:, :2 * bs], jnp.full((2,), 2 * bs, jnp.int32))
    out = model_step(m.params, cfg, toks[:, 2 * bs:], pos[:, 2 * bs:], jnp.ones((2, bs, bs), bool),
                     [Segment(0, cfg.num_layers, c.context())])
    np.testing.assert_allclose(np.asarray(lm_head(m.params, cfg, out.hidden)),
                               np.asarray(full[:, 2 * bs:]), atol=1e-4)
    np.testing.assert_allclose(np.asarray(lm_head(m.params, cfg, pre.hidden)),
                               np.asarray(full[:, :2 * bs]), atol=1e-4)


def test_block_causal_differs_from_bidirectional_and_public_forward():
    m = tiny_model("sdar")
    toks = [list(range(1, 20))]
    a = maskahead_jax.forward(m, toks, attention="block_causal")
    b = maskahead_jax.forward(m, toks, attention="bidirectional")
    bs = m.config.block_size
    # the first block sees only itself under block-causal: earlier logits differ, shapes agree
    assert a.shape == b.shape == (1, 19, m.config.vocab_size)
    assert not np.allclose(np.asarray(a[0, :bs]), np.asarray(b[0, :bs]))
    assert np.allclose(np.asarray(a), np.asarray(maskahead_jax.forward(m, toks)))  # family default
    with pytest.raises(ValueError, match="attention"):
        maskahead_jax.forward(m, toks, attention="causal")


def test_one_statistics_request_is_answered_as_asked():
    """model.StatsRequest: the forward reports what the request names and nothing else (no mass
    without `mass`, query moments only with `moments`), pools by `pool` (max pooling is the
    reference's max over the rows, never the mean's value) and refuses an unknown pooling; the
    hidden states do not depend on the request."""
    from maskahead_jax.kernels import reference
    from maskahead_jax.model import StatsRequest

    m = tiny_model("sdar")
    cfg, bs = m.config, m.config.block_size
    rng = np.random.RandomState(1)
    toks = jnp.asarray(rng.randint(0, 40, size=(2, 3 * bs)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(3 * bs, dtype=jnp.int32), toks.shape)
    pre = model_step(m.params, cfg, toks[:, :2 * bs], pos[:, :2 * bs],
                     full_mask(pos[:, :2 * bs], "block_causal", bs), [Segment(0, cfg.num_layers, None)])
    c = kvc.empty(cfg.num_layers, 2, cfg.num_kv_heads, 4 * bs, cfg.head_dim, jnp.float32)
    c = kvc.append(c, pre.k, pre.v, pos[:, :2 * bs], jnp.full((2,), 2 * bs, jnp.int32))
    rows = jnp.asarray(rng.rand(2, bs) < 0.5).at[:, 0].set(True)
    step = lambda stats: model_step(m.params, cfg, toks[:, 2 * bs:], pos[:, 2 * bs:], jnp.ones((2, bs, bs), bool),
                                    [Segment(0, cfg.num_layers, c.context())], stats)
    plain, mean = step(None), step(StatsRequest(rows))
    assert plain.mass is None and plain.queries is None
    assert mean.mass.shape == (cfg.num_layers, 2, cfg.num_kv_heads, 4 * bs) and mean.queries is None
    moments = step(StatsRequest(rows, mass=False, moments=True))
    assert moments.mass is None and moments.score is None
    m1, m2 = moments.queries
    assert m1.shape == (cfg.num_layers, 2, cfg.num_kv_heads, cfg.group_size, cfg.head_dim)
    assert m2.shape == m1.shape + (cfg.head_dim,)
    mx = step(StatsRequest(rows, pool="max"))
    for out in (mean, moments, mx):
        np.testing.assert_array_equal(np.asarray(out.hidden), np.asarray(plain.hidden))
    # layer 0's max pooling by hand: the largest prefix probability any row (and head) gives a key
    from maskahead_jax.model.decoder import project_qkv
    from maskahead_jax.model.layers import rope_tables

    p0 = jax.tree_util.tree_map(lambda a: a[0], m.params["layers"])
    cos, sin = rope_tables(pos[:, 2 * bs:], cfg)
    q = project_qkv(p0, m.params["embed"][toks[:, 2 * bs:]], cos, sin, cfg)[0]
    ctx = c.context()
    lg = jnp.einsum("bhgtd,bhsd->bhgts", q, ctx.k[0]) / np.sqrt(cfg.head_dim)
    want = reference.prefix_mass(lg, ctx.valid[0], rows, "max")
    np.testing.assert_allclose(np.asarray(mx.mass[0]), np.asarray(want), atol=1e-5)
    assert not np.allclose(np.asarray(mx.mass[0]), np.asarray(mean.mass[0]), atol=1e-3)
    with pytest.raises(ValueError, match="pool must be one of"):
        step(StatsRequest(rows, pool="sum"))
