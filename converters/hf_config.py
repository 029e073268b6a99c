"""Hugging Face `config.json` -> `ModelConfig`, for every supported family.

`model_config_from_hf(dict)` reads the real `config.json` of Fast-dLLM v2 / Dream (Qwen2 layout),
SDAR / DreamReasoner (Qwen3 layout), LLaDA-8B and LLaDA2.0-mini (BailingMoeV2 layout): it picks
the family and key layout from `model_type` (and the config's markers), maps the architecture
fields, then fills the block-diffusion behaviour (attention, logit shift, commit rule, mask / eos /
pad ids, threshold, block size) from the config where it says so and from the family's
`FamilyDefaults` (maskahead_jax.config.FAMILY_DEFAULTS) where it does not.

A qwen2 / qwen3 config with no block-diffusion marker is a plain autoregressive model and is
refused with a ConfigError, unless the family is forced (`family=`).

`model_type: "Dream"` names both Dream-v0 (Qwen2 layout: q/k/v bias, no q/k norm) and
DreamReasoner (Qwen3 layout: per-head q/k RMSNorm, no bias). `dream_variant` tells them apart: an
explicit q/k-norm flag in the config first, then the checkpoint's own tensor names when the caller
can list them (`keys=`; `checkpoint_keys(folder)` reads only the safetensors headers / index),
then Qwen3's `attention_bias: false`; with none of these the config is read as Dream-v0.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterable, Optional, Union

from maskahead_jax.config import FAMILY_DEFAULTS, ConfigError, ModelConfig

# model_type (lower-cased) -> (family, key layout)
MODEL_TYPES = {
    "fast_dllm_qwen": ("fast_dllm_v2", "qwen2"),
    "qwen2": ("fast_dllm_v2", "qwen2"),
    "dream": ("dream", "qwen2"),  # DreamReasoner also says "Dream"; told apart by q/k norm
    "sdar": ("sdar", "qwen3"),
    "qwen3": ("sdar", "qwen3"),
    "dream_reasoner": ("dream_reasoner", "qwen3"),
    "llada": ("llada", "llada"),
    "llama": ("llada", "llada"),
    "llada2_moe": ("llada2", "llada2"),
    "llada2_moe_veomni": ("llada2", "llada2"),
    "bailing_moe_v2": ("llada2", "llada2"),
    "bailing_moe": ("llada2", "llada2"),
}

# model_types that are also plain autoregressive backbones: such a config.json must say it is a
# diffusion LM (Fast-dLLM v2 writes bd_size, SDAR block_size) or the family must be forced
_AR_BACKBONES = ("qwen2", "qwen3")
_DIFFUSION_KEYS = ("bd_size", "block_size", "mask_token_id", "family")
_DIFFUSION_NAMES = ("dllm", "sdar", "dream", "llada", "diffusion")

Keys = Union[Iterable[str], Callable[[], Optional[Iterable[str]]], None]


def model_config_from_hf(hf: dict[str, Any], family: Optional[str] = None, keys: Keys = None,
                         **overrides) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face `config.json` dict of any supported family.

    family: force the family (its defaults) instead of the one the config implies; needed
    for a qwen2 / qwen3 config without a block-diffusion marker, which is otherwise refused
    as a plain autoregressive model.
    keys: the checkpoint's tensor names (or a function returning them, called only when the
    config is ambiguous: a "Dream" config without a q/k-norm flag, see `dream_variant`).
    overrides: ModelConfig fields set last (before the config is validated)."""
    mt = str(hf.get("model_type", "")).lower()
    if mt not in MODEL_TYPES:
        raise ConfigError(
            f"unknown model_type {hf.get('model_type')!r}; supported: {sorted(MODEL_TYPES)}")
    implied, layout = MODEL_TYPES[mt]
    family = family or hf.get("family")  # our own testbed configs name the family explicitly
    if family is None:
        family = implied
        if mt in _AR_BACKBONES and not has_diffusion_marker(hf):
            arch = ", ".join(map(str, hf.get("architectures") or [])) or f"model_type {mt}"
            raise ConfigError(
                f"{arch} is a plain autoregressive model, not a diffusion LM (no {'/'.join(_DIFFUSION_KEYS)} "
                f"field, no diffusion architecture name); if it really is a {family} checkpoint, force the "
                f"family: load_pretrained(path, family={family!r}) or --family {family}")
    if family not in FAMILY_DEFAULTS:
        raise ConfigError(f"unknown family {family!r}; supported: {sorted(FAMILY_DEFAULTS)}")
    if family == "dream":  # also a forced family="dream" on a Qwen3-layout config
        family = "dream_reasoner" if layout == "qwen3" else dream_variant(hf, keys)
    kw = _llada_fields(hf, family) if layout == "llada" else _qwen_fields(hf, family, layout)
    return _with_family_defaults(kw, hf, overrides)


def model_config_from_file(path: str, family: Optional[str] = None, **overrides) -> ModelConfig:
    """Read `config.json` (or a folder holding one); see `model_config_from_hf`. The tensor names
    of the folder's safetensors settle an ambiguous "Dream" config (`checkpoint_keys`)."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no config.json at {path}")
    with open(path) as f:
        hf = json.load(f)
    folder = os.path.dirname(os.path.abspath(path))
    return model_config_from_hf(hf, family=family, keys=lambda: checkpoint_keys(folder), **overrides)


def checkpoint_keys(folder: str) -> Optional[list[str]]:
    """The tensor names of an HF folder's safetensors weights, without reading any tensor: the
    `weight_map` of model.safetensors.index.json, else the header of every *.safetensors file
    (`safetensors.safe_open(...).keys()`). None when there are no safetensors (torch .bin, a
    converted folder) or they cannot be read (the weight loader reports that, with its reasons)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    try:
        if os.path.exists(index):
            with open(index) as f:
                return sorted(json.load(f)["weight_map"])
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        if not files:
            return None
        from safetensors import safe_open

        names: list[str] = []
        for name in files:
            with safe_open(os.path.join(folder, name), framework="numpy") as st:
                names.extend(st.keys())
        return names
    except Exception:  # noqa: BLE001 - unreadable here means: decide without the names
        return None


def dream_variant(hf: dict[str, Any], keys: Keys = None) -> str:
    """"dream" (Dream-v0: Qwen2 layout) or "dream_reasoner" (Qwen3 layout) for a "Dream" config.

    In order: the config's own q/k-norm flag (`use_qk_norm` / `qk_norm`); the checkpoint's tensor
    names (`*.self_attn.q_norm.weight` / `k_norm` -> DreamReasoner, `*.self_attn.q_proj.bias` ->
    Dream-v0); Qwen3's `attention_bias: false` (Dream-v0 has q/k/v biases); else Dream-v0."""
    for flag in ("use_qk_norm", "qk_norm"):
        if hf.get(flag) is not None:
            return "dream_reasoner" if hf[flag] else "dream"
    names = keys() if callable(keys) else keys
    if names is not None:
        names = list(names)
        if any(k.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")) for k in names):
            return "dream_reasoner"
        if any(k.endswith(("self_attn.q_proj.bias", "self_attn.k_proj.bias")) for k in names):
            return "dream"
    if hf.get("attention_bias") is False:
        return "dream_reasoner"
    return "dream"


def has_diffusion_marker(hf: dict[str, Any]) -> bool:
    """Whether a config.json says it is a block-diffusion LM (a field, or an architecture name)."""
    if any(k in hf for k in _DIFFUSION_KEYS):
        return True
    names = [str(n) for n in hf.get("architectures") or []] + [str(v) for v in (hf.get("auto_map") or {}).values()]
    return any(d in n.lower() for n in names for d in _DIFFUSION_NAMES)


def _qwen_fields(hf: dict[str, Any], family: str, layout: str) -> dict[str, Any]:
    """Architecture fields of the qwen2 / qwen3 / llada2 layouts (HF transformers naming)."""
    g = hf.get
    hidden = g("hidden_size")
    heads = g("num_attention_heads")
    if hidden is None or heads is None:
        raise ConfigError("config.json lacks hidden_size / num_attention_heads")
    head_dim = g("head_dim") or hidden // heads
    qk_norm = layout in ("qwen3", "llada2") and g("use_qk_norm", True)
    if family == "dream_reasoner" and layout == "qwen2":
        layout, qk_norm = "qwen3", True
    rotary = 0
    if layout == "llada2":
        rotary = int(head_dim * float(g("partial_rotary_factor", 1.0)))
        rotary = 0 if rotary == head_dim else rotary
    kw = dict(
        family=family,
        layout=layout,
        vocab_size=g("vocab_size"),
        hidden_size=hidden,
        num_layers=g("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=g("num_key_value_heads") or heads,
        head_dim=head_dim,
        intermediate_size=g("intermediate_size"),
        rms_eps=float(g("rms_norm_eps", 1e-6)),
        rope_theta=float(g("rope_theta", (g("rope_parameters") or {}).get("rope_theta", 10000.0))),
        rotary_dim=rotary,
        qkv_bias=bool(g("use_qkv_bias", layout == "qwen2")) if layout == "llada2" else layout == "qwen2",
        qk_norm=bool(qk_norm),
        tie_embeddings=bool(g("tie_word_embeddings", False)),
        max_position_embeddings=int(g("max_position_embeddings", 32768)),
    )
    if layout == "llada2":
        kw.update(
            num_experts=int(g("num_experts", 0)),
            num_experts_per_tok=int(g("num_experts_per_tok", 0)),
            moe_intermediate_size=int(g("moe_intermediate_size", 0)),
            num_shared_experts=int(g("num_shared_experts", 0) or 0),
            first_k_dense_replace=int(g("first_k_dense_replace", 0)),
            n_group=int(g("n_group", 1) or 1),
            topk_group=int(g("topk_group", 1) or 1),
            routed_scaling_factor=float(g("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(g("norm_topk_prob", True)),
        )
    return kw


def _llada_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """Architecture fields of LLaDA-8B's own (OLMo-style) config naming."""
    g = hf.get
    if g("block_type", "llama") != "llama":
        raise ConfigError(f"LLaDA block_type {g('block_type')!r} is not supported (only 'llama')")
    d = g("d_model") or g("hidden_size")
    heads = g("n_heads") or g("num_attention_heads")
    return dict(
        family=family,
        layout="llada",
        vocab_size=g("embedding_size") or g("vocab_size"),
        hidden_size=d,
        num_layers=g("n_layers") or g("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=g("n_kv_heads") or g("num_key_value_heads") or heads,
        head_dim=d // heads,
        intermediate_size=g("mlp_hidden_size") or g("intermediate_size"),
        rms_eps=float(g("rms_norm_eps", g("layer_norm_eps", 1e-5))),
        rope_theta=float(g("rope_theta", 10000.0)),
        qkv_bias=bool(g("include_qkv_bias", False)),
        tie_embeddings=bool(g("weight_tying", g("tie_word_embeddings", False))),
        max_position_embeddings=int(g("max_sequence_length", g("max_position_embeddings", 4096))),
    )


def _with_family_defaults(kw: dict[str, Any], hf: dict[str, Any], overrides: dict[str, Any]) -> ModelConfig:
    """Fill the block-diffusion fields: the config's own value, else the family default."""
    d = FAMILY_DEFAULTS[kw["family"]]
    eos = d.eos_token_ids
    eos_hf = hf.get("eos_token_id")
    if isinstance(eos_hf, int):
        eos = (eos_hf,)
    elif isinstance(eos_hf, (list, tuple)) and eos_hf:
        eos = tuple(int(e) for e in eos_hf)
    kw.update(
        attention=hf.get("attention", d.attention),
        logits_shift=bool(hf.get("logits_shift", d.logits_shift)),
        commit_rule=hf.get("commit_rule", d.commit_rule),
        threshold=float(hf.get("threshold", d.threshold)),
        mask_token_id=int(hf.get("mask_token_id", d.mask_token_id)),
        eos_token_ids=eos,
        pad_token_id=int(hf.get("pad_token_id") if hf.get("pad_token_id") is not None else eos[0]),
        block_size=int(hf.get("bd_size", hf.get("block_size", hf.get("block_length", 32)) or 32)),
    )
    kw.update(overrides)
    if kw.get("eos_token_ids") is not None:
        kw["eos_token_ids"] = tuple(kw["eos_token_ids"])
    return ModelConfig(**kw)
