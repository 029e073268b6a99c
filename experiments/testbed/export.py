"""Write the testbed's params as an HF folder: model.safetensors through the converters' own key
tables (`converters.export.save_hf`, the loader's plan run backwards: no key map of our own),
config.json (`hf_config`) and the testbed tokenizer. `load_pretrained` reads the folder back,
and re-exporting a loaded export writes the same bytes (tests/test_train_testbed.py)."""
from __future__ import annotations

import os

import jax
import numpy as np

from maskahead_jax import tasks as T
from maskahead_jax.config import ModelConfig
from maskahead_jax.model.rope import hf_fields as rope_hf_fields

# per key layout: (architectures, model_type); both read back as the config's layout
# (converters.hf_config.MODEL_TYPES: "sdar" -> qwen3 keys, "fast_dllm_qwen" -> qwen2 keys)
_HF_NAMES = {"qwen3": ("SDARForCausalLM", "sdar"), "qwen2": ("Fast_dLLM_QwenForCausalLM", "fast_dllm_qwen")}


def hf_config(cfg: ModelConfig) -> dict:
    """config.json of a testbed export: the HF architecture fields plus our block-diffusion ones
    (family, mask / eos / pad / bos ids, block size, attention, logits shift, commit rule and
    threshold), which `converters.hf_config.model_config_from_hf` reads back into `cfg`."""
    if cfg.layout not in _HF_NAMES:
        raise ValueError(f"the testbed exports the qwen3 (SDAR) or qwen2 (Fast-dLLM v2) layout, not {cfg.layout!r}")
    arch, model_type = _HF_NAMES[cfg.layout]
    return {
        "architectures": [arch], "model_type": model_type, "family": cfg.family,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta, "hidden_act": "silu", "attention_bias": cfg.qkv_bias,
        "use_qk_norm": cfg.qk_norm, "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings, "torch_dtype": "bfloat16",
        "mask_token_id": cfg.mask_token_id, "eos_token_id": cfg.eos_token_ids[0],
        "pad_token_id": cfg.pad_token_id, "bos_token_id": T.BOS_ID, "block_size": cfg.block_size,
        "attention": cfg.attention, "logits_shift": cfg.logits_shift, "commit_rule": cfg.commit_rule,
        "threshold": cfg.threshold,
        **rope_hf_fields(cfg),  # the RoPE scaling, if any (maskahead_jax.model.rope)
    }


def export_hf(params, cfg: ModelConfig, out_dir: str) -> str:
    """Write the params as an HF folder (bfloat16 safetensors, config.json, tokenizer.json) in
    `out_dir`; returns `out_dir`."""
    import ml_dtypes

    from converters.export import save_hf

    P = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32), params)
    save_hf(P, cfg, out_dir, config=hf_config(cfg), dtype=ml_dtypes.bfloat16)
    T.save_tokenizer(os.path.join(out_dir, "tokenizer.json"))
    return out_dir
