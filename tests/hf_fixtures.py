"""Tiny random PyTorch/transformers models saved in each supported HF key layout.

The references for the converter and logit-parity tests: Qwen2 and Qwen3 as they are;
Llama renamed into LLaDA-8B's OLMo keys; Glm4Moe renamed and fused into LLaDA2.0-mini's
BailingMoeV2 keys. Weights are re-drawn with O(1) scale (and non-trivial norms, biases and
router bias) so a wrongly mapped tensor changes the logits visibly. Import only after
`pytest.importorskip("torch")`.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from safetensors.torch import save_file

VOCAB, HIDDEN, FFN, BLOCK = 96, 32, 48, 4


@dataclass
class Case:
    """A torch reference model and the HF-layout folder written from it."""

    name: str
    model: torch.nn.Module
    path: str


def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Redraw every parameter and float buffer: norms ~ 1 + 0.1 N, biases ~ 0.1 N, matrices ~ N / sqrt(fan_in)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        tensors = dict(model.named_parameters())
        tensors.update({k: b for k, b in model.named_buffers()
                        if b.is_floating_point() and "bias" in k})
        for name, t in sorted(tensors.items()):
            noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                new = 1.0 + 0.1 * noise
            elif t.ndim == 1:
                new = 0.1 * noise
            else:
                new = noise / t.shape[-1] ** 0.5
            t.copy_(new.to(t.dtype))
    return model.eval()


def additive_mask(allowed: np.ndarray, dtype=torch.float32) -> torch.Tensor:
    """[B, T, T] bool -> the 4D additive float mask [B, 1, T, T] transformers passes through as-is."""
    m = torch.from_numpy(np.asarray(allowed))[:, None]
    return torch.where(m, 0.0, torch.finfo(dtype).min).to(dtype)


def allowed_mask(kind: str, batch: int, t: int, block: int = BLOCK) -> np.ndarray:
    """Boolean [B, T, T]: bidirectional, or block-causal (key block <= query block)."""
    if kind == "bidirectional":
        m = np.ones((t, t), bool)
    else:
        b = np.arange(t) // block
        m = b[None, :] <= b[:, None]
    return np.broadcast_to(m, (batch, t, t)).copy()


def torch_logits(model: torch.nn.Module, tokens: np.ndarray, kind: str) -> np.ndarray:
    """float32 logits of the torch reference under the given mask kind."""
    dtype = next(model.parameters()).dtype
    mask = additive_mask(allowed_mask(kind, *tokens.shape), dtype)
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(np.asarray(tokens, np.int64)), attention_mask=mask)
    return out.logits.float().numpy()


def write_checkpoint(path: str, sd: dict[str, torch.Tensor], config: dict, fmt: str = "safetensors") -> str:
    """Write a state dict + config.json as an HF folder: safetensors, sharded safetensors, or .bin."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    sd = {k: v.detach().contiguous().clone() for k, v in sd.items()}
    if fmt == "safetensors":
        save_file(sd, os.path.join(path, "model.safetensors"))
    elif fmt == "sharded":
        keys = sorted(sd)
        halves = [keys[: len(keys) // 2], keys[len(keys) // 2:]]
        names = [f"model-{i + 1:05d}-of-00002.safetensors" for i in range(2)]
        for ks, name in zip(halves, names):
            save_file({k: sd[k] for k in ks}, os.path.join(path, name))
        index = {"metadata": {}, "weight_map": {k: n for ks, n in zip(halves, names) for k in ks}}
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f)
    elif fmt == "bin":
        torch.save(sd, os.path.join(path, "pytorch_model.bin"))
    else:
        raise ValueError(fmt)
    return path


def rename(sd: dict[str, torch.Tensor], rules: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """Apply the first matching (regex, replacement) to every key."""
    out = {}
    for k, v in sd.items():
        for pat, rep in rules:
            if re.match(pat, k):
                k = re.sub(pat, rep, k, count=1)
                break
        out[k] = v
    return out


# ------------------------------------------------------------------ families


def qwen2(path: str, seed: int = 0, tie: bool = False, **config) -> Case:
    """Fast-dLLM v2 / Dream layout: Qwen2 with q/k/v bias, saved by save_pretrained. config.json
    carries Fast-dLLM v2's `bd_size` (what marks a qwen2 config as a diffusion LM) and a mask id
    inside the tiny vocabulary. config: more Qwen2Config fields (e.g. rope_parameters)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**{**dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                                rope_theta=10000.0, bd_size=BLOCK, mask_token_id=VOCAB - 1,
                                attn_implementation="eager"), **config})
    model = randomize_(Qwen2ForCausalLM(cfg), seed)
    if tie:
        model.tie_weights()
    model.save_pretrained(path)
    return Case("qwen2", model, path)


def qwen3(path: str, seed: int = 0, **config) -> Case:
    """SDAR / DreamReasoner layout: Qwen3 with per-head q/k RMSNorm and no bias. config.json carries
    SDAR's `block_size` (the diffusion marker of a qwen3 config) and a mask id inside the vocabulary.
    config: more Qwen3Config fields (e.g. rope_parameters)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**{**dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
                                rope_theta=1e6, block_size=BLOCK, mask_token_id=VOCAB - 1,
                                attn_implementation="eager"), **config})
    model = randomize_(Qwen3ForCausalLM(cfg), seed)
    model.save_pretrained(path)
    return Case("qwen3", model, path)


_LLADA_KEYS = [
    (r"model\.embed_tokens\.weight$", "model.transformer.wte.weight"),
    (r"model\.norm\.weight$", "model.transformer.ln_f.weight"),
    (r"lm_head\.weight$", "model.transformer.ff_out.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.", r"model.transformer.blocks.\1.attn_norm."),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.", r"model.transformer.blocks.\1.ff_norm."),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.", r"model.transformer.blocks.\1.attn_out."),
    (r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.", r"model.transformer.blocks.\1.\2_proj."),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.", r"model.transformer.blocks.\1.ff_proj."),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.", r"model.transformer.blocks.\1.up_proj."),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.", r"model.transformer.blocks.\1.ff_out."),
]


def llada(path: str, seed: int = 0, fmt: str = "safetensors", rope_scaling: dict | None = None,
          max_positions: int = 4096) -> Case:
    """LLaDA-8B layout: Llama (MHA, no bias) renamed into the OLMo block keys, LLaDA config.json.
    rope_scaling: an HF rope_scaling dict given to both the Llama model and config.json."""
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = 4
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=heads, rms_norm_eps=1e-5,
                      rope_theta=500000.0, tie_word_embeddings=False, attn_implementation="eager",
                      max_position_embeddings=max_positions,
                      **({"rope_scaling": dict(rope_scaling)} if rope_scaling else {}))
    model = randomize_(LlamaForCausalLM(cfg), seed)
    config = {"model_type": "llada", "architectures": ["LLaDAModelLM"], "d_model": HIDDEN, "n_layers": 2,
              "n_heads": heads, "n_kv_heads": heads, "mlp_hidden_size": FFN, "embedding_size": VOCAB,
              "vocab_size": VOCAB, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "block_type": "llama",
              "include_qkv_bias": False, "include_bias": False, "weight_tying": False,
              "max_sequence_length": max_positions, "mask_token_id": VOCAB - 1,
              **({"rope_scaling": rope_scaling} if rope_scaling else {})}
    write_checkpoint(path, rename(model.state_dict(), _LLADA_KEYS), config, fmt)
    return Case("llada", model, path)


def llada2_state_dict(model: torch.nn.Module, cfg) -> dict[str, torch.Tensor]:
    """Glm4Moe weights in LLaDA2.0-mini's keys: fused QKV, per-expert MLPs, expert_bias."""
    h, hk, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    out = {"model.word_embeddings.weight": model.model.embed_tokens.weight,
           "model.norm.weight": model.model.norm.weight, "lm_head.weight": model.lm_head.weight}
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        a = layer.self_attn
        assert a.q_proj.weight.shape[0] == h * dh and a.k_proj.weight.shape[0] == hk * dh
        out[p + "attention.query_key_value.weight"] = torch.cat(
            [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0)
        out[p + "attention.query_layernorm.weight"] = a.q_norm.weight
        out[p + "attention.key_layernorm.weight"] = a.k_norm.weight
        out[p + "attention.dense.weight"] = a.o_proj.weight
        out[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        mlp = layer.mlp
        if i < cfg.first_k_dense_replace:
            for n in ("gate_proj", "up_proj", "down_proj"):
                out[p + f"mlp.{n}.weight"] = getattr(mlp, n).weight
            continue
        out[p + "mlp.gate.weight"] = mlp.gate.weight
        out[p + "mlp.gate.expert_bias"] = mlp.gate.e_score_correction_bias
        fe = cfg.moe_intermediate_size
        for e in range(cfg.n_routed_experts):
            gate_up = mlp.experts.gate_up_proj[e]  # [2 Fe, D]: gate rows first (chunk(2) order)
            out[p + f"mlp.experts.{e}.gate_proj.weight"] = gate_up[:fe]
            out[p + f"mlp.experts.{e}.up_proj.weight"] = gate_up[fe:]
            out[p + f"mlp.experts.{e}.down_proj.weight"] = mlp.experts.down_proj[e]
        for n in ("gate_proj", "up_proj", "down_proj"):
            out[p + f"mlp.shared_experts.{n}.weight"] = getattr(mlp.shared_experts, n).weight
    return out


def llada2(path: str, seed: int = 0, fmt: str = "safetensors", static_routing: bool = False,
           **overrides) -> Case:
    """LLaDA2.0-mini layout from Glm4Moe: sigmoid group-limited routing with bias, shared expert,
    partial RoPE (factor 0.5), q/k norm, first layer dense.

    static_routing: expert biases 2 apart (scores lie in (0, 1)), so the selection no longer depends
    on the input and low-precision runs cannot flip a near-tied expert choice; the combine weights
    still come from the input-dependent scores."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=FFN, moe_intermediate_size=16,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, n_routed_experts=16,
              n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
              routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True, first_k_dense_replace=1,
              rms_norm_eps=1e-6, attention_bias=False, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 600000.0, "partial_rotary_factor": 0.5},
              attn_implementation="eager")
    kw.update(overrides)
    cfg = Glm4MoeConfig(**kw)
    model = randomize_(Glm4MoeForCausalLM(cfg), seed)
    if static_routing:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for layer in model.model.layers[cfg.first_k_dense_replace:]:
                perm = torch.randperm(cfg.n_routed_experts, generator=g).float()
                layer.mlp.gate.e_score_correction_bias.copy_(2.0 * perm)
    config = {"model_type": "llada2_moe", "architectures": ["LLaDA2MoeModelLM"],
              "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
              "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
              "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
              "head_dim": cfg.hidden_size // cfg.num_attention_heads, "rms_norm_eps": cfg.rms_norm_eps,
              "rope_theta": cfg.rope_parameters["rope_theta"], "partial_rotary_factor": 0.5,
              "num_experts": cfg.n_routed_experts, "num_shared_experts": cfg.n_shared_experts,
              "num_experts_per_tok": cfg.num_experts_per_tok, "moe_intermediate_size": cfg.moe_intermediate_size,
              "n_group": cfg.n_group, "topk_group": cfg.topk_group,
              "routed_scaling_factor": cfg.routed_scaling_factor, "norm_topk_prob": cfg.norm_topk_prob,
              "first_k_dense_replace": cfg.first_k_dense_replace, "score_function": "sigmoid",
              "use_qkv_bias": False, "use_bias": False, "use_qk_norm": True, "tie_word_embeddings": False,
              "max_position_embeddings": 4096, "mask_token_id": VOCAB - 1, "eos_token_id": VOCAB - 2}
    write_checkpoint(path, llada2_state_dict(model, cfg), config, fmt)
    return Case("llada2", model, path)


BUILDERS: dict[str, Callable[..., Case]] = {"qwen2": qwen2, "qwen3": qwen3, "llada": llada, "llada2": llada2}
