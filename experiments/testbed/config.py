"""The testbed's ModelConfig from the command line's shape flags (--layers, --d-model, --heads,
--kv-heads, --head-dim, --ffn, --rope-theta, --rope-scaling, --max-positions, --layout,
--logits-shift, --untied, --no-qk-norm)."""
from __future__ import annotations

from maskahead_jax import tasks as T
from maskahead_jax.config import ModelConfig
from maskahead_jax.model.rope import with_rope

from .data import BLOCK

# The commit threshold an export's config.json carries (and so the held-out probe decodes with): 0.95
# since Dec 3 (0.85 before; docs/testbed_history.md's "Decoding threshold 0.95" chose it on validation seeds).
THRESHOLD = 0.95
MAX_POSITIONS = 8192  # max_position_embeddings of every testbed export so far


def head_dim(args) -> int:
    """--head-dim, or d_model / heads when it is not given."""
    return getattr(args, "head_dim", None) or args.d_model // args.heads


def make_config(args, vocab: int) -> ModelConfig:
    """SDAR layout (qwen3 keys, q/k RMSNorm) by default; --layout qwen2 gives Fast-dLLM v2's
    (q/k/v biases, no q/k norm). Block-causal attention, block 32, the tasks' special ids."""
    common = dict(
        vocab_size=vocab, hidden_size=args.d_model, num_layers=args.layers, num_heads=args.heads,
        num_kv_heads=args.kv_heads, head_dim=head_dim(args), intermediate_size=args.ffn, rms_eps=1e-6,
        rope_theta=args.rope_theta, tie_embeddings=not getattr(args, "untied", False),
        attention="block_causal", logits_shift=getattr(args, "logits_shift", False), mask_token_id=T.MASK_ID,
        eos_token_ids=(T.EOS_ID,), pad_token_id=T.PAD_ID, block_size=BLOCK,
        commit_rule="dynamic", threshold=THRESHOLD,
        max_position_embeddings=getattr(args, "max_positions", None) or MAX_POSITIONS)
    if getattr(args, "layout", "qwen3") == "qwen2":
        cfg = ModelConfig(family="fast_dllm_v2", layout="qwen2", qk_norm=False, qkv_bias=True, **common)
    else:
        cfg = ModelConfig(family="sdar", layout="qwen3", qk_norm=not getattr(args, "no_qk_norm", False), **common)
    if getattr(args, "rope_scaling", None):  # e.g. yarn:4:2048; the positions stay --max-positions
        cfg = with_rope(cfg, rope_scaling=args.rope_scaling, max_position_embeddings=common["max_position_embeddings"])
    return cfg
