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
from maskahead_jax.model.rope import OWN_KEY, scaling_from_hf

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
    _refuse_unsupported(hf, kw)
    kw.update(_rope_fields(hf, kw["max_position_embeddings"]))
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
    prf = g("partial_rotary_factor", (_rope_dict(hf)[0] or {}).get("partial_rotary_factor", 1.0))
    if layout == "llada2":
        rotary = int(head_dim * float(prf))
        rotary = 0 if rotary == head_dim else rotary
    elif prf not in (None, 1, 1.0):
        raise ConfigError(f"partial_rotary_factor={prf!r} is not supported for the {layout} layout (RoPE on "
                          "the whole head there)")
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
        num_kv_heads=g("n_kv_heads") or g("num_key_value_heads") or (1 if g("multi_query_attention") else heads),
        head_dim=d // heads,
        intermediate_size=g("mlp_hidden_size") or g("intermediate_size"),
        rms_eps=float(g("rms_norm_eps", g("layer_norm_eps", 1e-5))),
        qkv_bias=bool(g("include_qkv_bias", False)),
        tie_embeddings=bool(g("weight_tying", g("tie_word_embeddings", False))),
        max_position_embeddings=int(g("max_sequence_length", g("max_position_embeddings", 4096))),
    )


def _rope_dict(hf: dict[str, Any]) -> tuple[Optional[dict], str]:
    """The RoPE parameters dict and its key: `rope_scaling` when set (transformers puts it over
    `rope_parameters`), else `rope_parameters`; a per-layer-type dict gives its full_attention entry."""
    name = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    d = hf.get(name)
    if isinstance(d, dict) and isinstance(d.get("full_attention"), dict):
        return d["full_attention"], f"{name}.full_attention"
    return d, name


def _rope_fields(hf: dict[str, Any], max_positions: int) -> dict[str, Any]:
    """rope_theta and rope_scaling of a config.json, and the positions a scaling is made for.

    The base is the RoPE dict's `rope_theta` (transformers keeps it over the top-level one), else
    the top-level `rope_theta`, else 10000. A scaling raises max_position_embeddings to factor x
    original length when that is more. `maskahead_rope_scaling` (a scaling no transformers type
    names: dynamic_yarn) wins over `rope_scaling` / `rope_parameters`."""
    d, name = _rope_dict(hf)
    theta = (d or {}).get("rope_theta") if isinstance(d, dict) else None
    theta = hf.get("rope_theta") if theta is None else theta
    theta = (hf.get("rope_parameters") or {}).get("rope_theta") if theta is None and isinstance(
        hf.get("rope_parameters"), dict) else theta
    theta = 10000.0 if theta is None else theta
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < float("inf"):
        raise ConfigError(f"rope_theta must be a positive number, got {theta!r}")
    top = hf.get("original_max_position_embeddings")
    if hf.get(OWN_KEY) is not None:  # ours (dynamic_yarn), over the transformers-readable one
        d, name, top = hf[OWN_KEY], OWN_KEY, None
    scaling = scaling_from_hf(d, max_positions, top if isinstance(top, int) and top > 0 else None, where=name)
    out: dict[str, Any] = dict(rope_theta=float(theta), rope_scaling=scaling)
    if scaling is not None:
        out["max_position_embeddings"] = max(max_positions, scaling.extended_length)
    return out


_SILU = ("silu", "swish")  # transformers' ACT2FN: both are x * sigmoid(x)
_LLADA_OFF = ("alibi", "attention_layer_norm", "input_emb_norm", "scale_logits", "include_bias")


def _refuse_unsupported(hf: dict[str, Any], kw: dict[str, Any]) -> None:
    """ConfigError naming the field when config.json asks for math this library does not run:
    an activation other than SiLU, a sliding window shorter than the positions, LLaDA's (OLMo's)
    alibi / q-k layer norm / embedding norm / logit scaling / biases / no RoPE / non-RMS norm,
    BailingMoe's non-sigmoid router or output bias. docs/config_fields.md lists every field."""
    g = hf.get
    act_key = "activation_type" if kw["layout"] == "llada" else "hidden_act"
    act = g(act_key)
    if act is not None and str(act).lower() not in _SILU:
        raise ConfigError(f"{act_key}={act!r} is not supported (the MLP here is SwiGLU with SiLU)")
    if kw["layout"] == "llada":
        on = [k for k in _LLADA_OFF if g(k)]
        if on:
            raise ConfigError(f"{on[0]}={g(on[0])!r} is not supported (LLaDA's blocks here have none)")
        if g("rope") is False:
            raise ConfigError("rope=false is not supported (LLaDA's blocks here apply RoPE)")
        if g("clip_qkv") is not None:
            raise ConfigError(f"clip_qkv={g('clip_qkv')!r} is not supported (q/k/v are not clipped here)")
        if g("layer_norm_type") not in (None, "rms"):
            raise ConfigError(f"layer_norm_type={g('layer_norm_type')!r} is not supported (RMSNorm only)")
    if kw["layout"] == "llada2":
        if g("score_function") not in (None, "sigmoid"):
            raise ConfigError(f"score_function={g('score_function')!r} is not supported (sigmoid routing only)")
        if g("use_bias"):
            raise ConfigError("use_bias=true is not supported (no output-projection bias in this layout)")
    _refuse_sliding(hf, kw)


def _refuse_sliding(hf: dict[str, Any], kw: dict[str, Any]) -> None:
    """A sliding window narrower than the model's positions on any layer (transformers' Qwen2 /
    Qwen3 rule: `sliding_window` counts only with `use_sliding_window`; the layers are those
    `layer_types` names sliding_attention, else those from `max_window_layers` (default 28) on)."""
    types = hf.get("layer_types")
    if types is not None:
        odd = sorted({str(t) for t in types} - {"full_attention", "sliding_attention"})
        if odd:
            raise ConfigError(f"layer_types {odd} are not supported (full attention only)")
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    if window is None:
        return
    n = kw["num_layers"] or 0
    if types is not None:
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    else:
        sliding = list(range(int(hf.get("max_window_layers", 28) or 0), n))
    if sliding and window < kw["max_position_embeddings"]:
        raise ConfigError(f"use_sliding_window=true with sliding_window={window} (layers {sliding[0]}..{sliding[-1]}) "
                          f"is not supported: attention here reads all {kw['max_position_embeddings']} positions")


def _int_field(hf: dict[str, Any], key: str, default: int) -> int:
    v = hf.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v):
        raise ConfigError(f"{key} must be an integer, got {v!r}")
    return int(v)


def _token_ids(hf: dict[str, Any], key: str, vocab: Any) -> Optional[tuple[int, ...]]:
    """config.json's own token id(s) under `key`, each checked against the vocabulary."""
    v = hf.get(key)
    if v is None or (isinstance(v, (list, tuple)) and not v):
        return None
    ids = v if isinstance(v, (list, tuple)) else [v]
    if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ConfigError(f"{key} must be a token id or a list of them, got {v!r}")
    if isinstance(vocab, int):
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ConfigError(f"{key}={bad[0]} is not a token of the vocabulary [0, vocab_size={vocab})")
    return tuple(ids)


def _with_family_defaults(kw: dict[str, Any], hf: dict[str, Any], overrides: dict[str, Any]) -> ModelConfig:
    """Fill the block-diffusion fields: the config's own value, else the family default."""
    d = FAMILY_DEFAULTS[kw["family"]]
    eos = _token_ids(hf, "eos_token_id", kw.get("vocab_size")) or d.eos_token_ids
    pad = _token_ids(hf, "pad_token_id", kw.get("vocab_size"))
    threshold = hf.get("threshold", d.threshold)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold <= 1:
        raise ConfigError(f"threshold must be a number in (0, 1], got {threshold!r}")
    block = next((k for k in ("bd_size", "block_size", "block_length") if hf.get(k) is not None), None)
    if block and _int_field(hf, block, 32) <= 0:
        raise ConfigError(f"{block} must be a positive integer, got {hf[block]!r}")
    kw.update(
        attention=hf.get("attention", d.attention),
        logits_shift=bool(hf.get("logits_shift", d.logits_shift)),
        commit_rule=hf.get("commit_rule", d.commit_rule),
        threshold=float(threshold),
        mask_token_id=_int_field(hf, "mask_token_id", d.mask_token_id),
        eos_token_ids=eos,
        pad_token_id=pad[0] if pad else eos[0],
        block_size=_int_field(hf, block, 32) if block else 32,
    )
    kw.update(overrides)
    if kw.get("eos_token_ids") is not None:
        kw["eos_token_ids"] = tuple(kw["eos_token_ids"])
    return ModelConfig(**kw)
