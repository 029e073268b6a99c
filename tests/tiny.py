"""Tiny random models of every family for engine and policy tests."""
from __future__ import annotations

import jax

from maskahead_jax.api import Model
from maskahead_jax.config import ModelConfig
from maskahead_jax.model import init_params

VOCAB = 48
MASK = 47
EOS = 46

_BASE = dict(vocab_size=VOCAB, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
             intermediate_size=48, rope_theta=10000.0, mask_token_id=MASK, eos_token_ids=(EOS,),
             pad_token_id=EOS, block_size=8, max_position_embeddings=4096)

FAMILIES = {
    "fast_dllm_v2": dict(family="fast_dllm_v2", layout="qwen2", qkv_bias=True, attention="block_causal",
                         logits_shift=True, commit_rule="fast_dllm", threshold=0.9),
    "sdar": dict(family="sdar", layout="qwen3", qk_norm=True, attention="block_causal",
                 commit_rule="dynamic", threshold=0.85),
    "dream_reasoner": dict(family="dream_reasoner", layout="qwen3", qk_norm=True, attention="block_causal",
                           commit_rule="dream_reasoner", threshold=0.9),
    "llada2": dict(family="llada2", layout="llada2", qk_norm=True, rotary_dim=4, attention="block_causal",
                   commit_rule="dynamic", threshold=0.95, num_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=16, num_shared_experts=1, first_k_dense_replace=1, n_group=4,
                   topk_group=2, routed_scaling_factor=2.5),
    "llada": dict(family="llada", layout="llada", attention="bidirectional", commit_rule="llada",
                  num_kv_heads=4),
    "dream": dict(family="dream", layout="qwen2", qkv_bias=True, attention="bidirectional",
                  logits_shift=True, commit_rule="llada"),
}

BLOCK_CAUSAL = ["fast_dllm_v2", "sdar", "dream_reasoner", "llada2"]
BIDIRECTIONAL = ["llada", "dream"]


def tiny_model(family: str, seed: int = 0, scale: float = 0.3, **over) -> Model:
    kw = dict(_BASE)
    kw.update(FAMILIES[family])
    kw.update(over)
    cfg = ModelConfig(**kw)
    return Model(cfg, init_params(cfg, jax.random.PRNGKey(seed), scale=scale))


def tiny_testbed_cfg(**over) -> ModelConfig:
    """A tiny model in the testbed's vocabulary and block (32), for its trainers' objectives:
    the bidirectional twin's layout by default; `over` replaces any field."""
    from maskahead_jax import tasks as T

    base = dict(family="dream", layout="qwen3", vocab_size=T.get_tokenizer().get_vocab_size(), hidden_size=32,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, qk_norm=True,
                tie_embeddings=True, attention="bidirectional", logits_shift=True, mask_token_id=T.MASK_ID,
                eos_token_ids=(T.EOS_ID,), pad_token_id=T.PAD_ID, block_size=32, commit_rule="dynamic",
                threshold=0.95, max_position_embeddings=4096)
    base.update(over)
    return ModelConfig(**base)
