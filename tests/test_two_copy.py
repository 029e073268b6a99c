"""The chunked two-copy training forward against the dense-mask reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maskahead_jax.config import ModelConfig
from maskahead_jax.model.decoder import forward_hidden
from maskahead_jax.model.init import init_params
from maskahead_jax.model.two_copy import two_copy_hidden, two_copy_mask


@pytest.mark.parametrize("chunk,qkv_bias", [(32, False), (64, True), (512, False)])
def test_two_copy_hidden_matches_dense_mask(chunk, qkv_bias):
    cfg = ModelConfig(family="sdar", layout="qwen2" if qkv_bias else "qwen3",
                      vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, intermediate_size=48, qk_norm=not qkv_bias, qkv_bias=qkv_bias,
                      block_size=16, attention="block_causal")
    params = init_params(cfg, jax.random.PRNGKey(0))
    B, L = 2, 80  # 5 blocks: chunk 64 leaves a ragged last chunk
    xt = jax.random.randint(jax.random.PRNGKey(1), (B, L), 0, 64)
    x0 = jax.random.randint(jax.random.PRNGKey(2), (B, L), 0, 64)
    pos = jnp.broadcast_to(jnp.concatenate([jnp.arange(L), jnp.arange(L)]), (B, 2 * L))
    mask = jnp.broadcast_to(jnp.asarray(two_copy_mask(L, 16)), (B, 2 * L, 2 * L))
    want = forward_hidden(params, cfg, jnp.concatenate([xt, x0], 1), pos, mask=mask)
    got = two_copy_hidden(params, cfg, xt, x0, chunk=chunk)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_two_copy_rejects_ragged_chunk():
    cfg = ModelConfig(family="sdar", layout="qwen3", vocab_size=64, hidden_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=2, head_dim=16, intermediate_size=48, block_size=16,
                      attention="block_causal")
    params = init_params(cfg, jax.random.PRNGKey(0))
    x = jnp.zeros((1, 32), jnp.int32)
    with pytest.raises(ValueError, match="multiples of the block"):
        two_copy_hidden(params, cfg, x, x, chunk=24)
