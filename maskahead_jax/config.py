"""Model and generation configuration: frozen, hashable dataclasses.

`ModelConfig.from_hf(dict)` reads the real `config.json` of every supported family:
Fast-dLLM v2 / Dream (Qwen2 layout), SDAR / DreamReasoner (Qwen3 layout), LLaDA-8B and
LLaDA2.0-mini (BailingMoeV2 layout). Family defaults (attention mask, logit shift, mask/eos ids,
block size) come from the config and can be overridden.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

# model_type (lower-cased) -> (family, key layout)
_MODEL_TYPES = {
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

# family -> (attention, logit shift, commit rule, default mask id, default eos ids, threshold)
FAMILY_DEFAULTS = {
    "fast_dllm_v2": ("block_causal", True, "fast_dllm", 151665, (151645,), 0.9),
    "dream": ("bidirectional", True, "llada", 151666, (151643,), 0.9),
    "sdar": ("block_causal", False, "dynamic", 151669, (151643, 151645), 0.85),
    "dream_reasoner": ("block_causal", False, "dream_reasoner", 151669, (151643, 151645), 0.9),
    "llada": ("bidirectional", False, "llada", 126336, (126081, 126348), 0.9),
    "llada2": ("block_causal", False, "dynamic", 156895, (156892,), 0.95),
}

ATTENTION_KINDS = ("bidirectional", "block_causal")

# model_types that are also plain autoregressive backbones: such a config.json must say it is a
# diffusion LM (Fast-dLLM v2 writes bd_size, SDAR block_size) or the family must be forced
_AR_BACKBONES = ("qwen2", "qwen3")
_DIFFUSION_KEYS = ("bd_size", "block_size", "mask_token_id", "family")
_DIFFUSION_NAMES = ("dllm", "sdar", "dream", "llada", "diffusion")


class ConfigError(ValueError):
    """A config.json that this library cannot run (unknown model_type, bad field)."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the pure-function model needs; hashable so it can be a static jit arg."""

    family: str
    layout: str  # checkpoint key layout: qwen2 | qwen3 | llada | llada2
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    rotary_dim: int = 0  # 0 -> head_dim (full RoPE); LLaDA2 uses head_dim // 2
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    # MoE (LLaDA2.0 / BailingMoeV2); num_experts == 0 means dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    first_k_dense_replace: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    # block diffusion behaviour (family defaults, overridable)
    attention: str = "block_causal"
    logits_shift: bool = False
    mask_token_id: int = 0
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    block_size: int = 32
    commit_rule: str = "dynamic"
    threshold: float = 0.9
    max_position_embeddings: int = 32768

    def __post_init__(self):
        if self.attention not in ATTENTION_KINDS:
            raise ConfigError(f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ConfigError(f"rotary_dim={self.rotary_dim} must be even and <= head_dim")
        if self.vocab_size is None or self.vocab_size < 1:
            raise ConfigError(f"vocab_size must be a positive integer, got {self.vocab_size!r}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"mask_token_id={self.mask_token_id} is not a token of the vocabulary "
                              f"[0, vocab_size={self.vocab_size})")

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_dense_mlp_layers(self) -> int:
        """Layers [0, n) use a dense SwiGLU MLP; the rest use the MoE."""
        return min(self.first_k_dense_replace, self.num_layers) if self.is_moe else self.num_layers

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    # ------------------------------------------------------------------ HF config reading
    @classmethod
    def from_hf(cls, hf: dict[str, Any], family: Optional[str] = None, **overrides) -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict of any supported family.

        family: force the family (its defaults) instead of the one the config implies; needed
        for a qwen2 / qwen3 config without a block-diffusion marker, which is otherwise refused
        as a plain autoregressive model."""
        mt = str(hf.get("model_type", "")).lower()
        if mt not in _MODEL_TYPES:
            raise ConfigError(
                f"unknown model_type {hf.get('model_type')!r}; supported: {sorted(_MODEL_TYPES)}")
        implied, layout = _MODEL_TYPES[mt]
        family = family or hf.get("family")  # our own testbed configs name the family explicitly
        if family is None:
            family = implied
            if mt in _AR_BACKBONES and not _has_diffusion_marker(hf):
                arch = ", ".join(map(str, hf.get("architectures") or [])) or f"model_type {mt}"
                raise ConfigError(
                    f"{arch} is a plain autoregressive model, not a diffusion LM (no {'/'.join(_DIFFUSION_KEYS)} "
                    f"field, no diffusion architecture name); if it really is a {family} checkpoint, force the "
                    f"family: load_pretrained(path, family={family!r}) or --family {family}")
        if family not in FAMILY_DEFAULTS:
            raise ConfigError(f"unknown family {family!r}; supported: {sorted(FAMILY_DEFAULTS)}")
        if layout == "llada":
            return cls._from_llada(hf, family, overrides)
        g = hf.get
        hidden = g("hidden_size")
        heads = g("num_attention_heads")
        if hidden is None or heads is None:
            raise ConfigError("config.json lacks hidden_size / num_attention_heads")
        head_dim = g("head_dim") or hidden // heads
        if family == "dream" and (g("use_qk_norm") or layout == "qwen3"):
            family = "dream_reasoner"
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
        return cls._with_family_defaults(kw, hf, overrides)

    @classmethod
    def _from_llada(cls, hf, family, overrides):
        g = hf.get
        if g("block_type", "llama") != "llama":
            raise ConfigError(f"LLaDA block_type {g('block_type')!r} is not supported (only 'llama')")
        d = g("d_model") or g("hidden_size")
        heads = g("n_heads") or g("num_attention_heads")
        kw = dict(
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
        return cls._with_family_defaults(kw, hf, overrides)

    @classmethod
    def _with_family_defaults(cls, kw, hf, overrides):
        attn, shift, rule, mask_id, eos, thr = FAMILY_DEFAULTS[kw["family"]]
        eos_hf = hf.get("eos_token_id")
        if isinstance(eos_hf, int):
            eos = (eos_hf,)
        elif isinstance(eos_hf, (list, tuple)) and eos_hf:
            eos = tuple(int(e) for e in eos_hf)
        kw.update(
            attention=hf.get("attention", attn),
            logits_shift=bool(hf.get("logits_shift", shift)),
            commit_rule=hf.get("commit_rule", rule),
            threshold=float(hf.get("threshold", thr)),
            mask_token_id=int(hf.get("mask_token_id", mask_id)),
            eos_token_ids=eos,
            pad_token_id=int(hf.get("pad_token_id") if hf.get("pad_token_id") is not None else eos[0]),
            block_size=int(hf.get("bd_size", hf.get("block_size", hf.get("block_length", 32)) or 32)),
        )
        kw.update(overrides)
        if kw.get("eos_token_ids") is not None:
            kw["eos_token_ids"] = tuple(kw["eos_token_ids"])
        return cls(**kw)

    @classmethod
    def from_file(cls, path: str, family: Optional[str] = None, **overrides) -> "ModelConfig":
        """Read `config.json` (or a folder holding one)."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no config.json at {path}")
        with open(path) as f:
            return cls.from_hf(json.load(f), family=family, **overrides)


def _has_diffusion_marker(hf: dict[str, Any]) -> bool:
    """Whether a config.json says it is a block-diffusion LM (a field, or an architecture name)."""
    if any(k in hf for k in _DIFFUSION_KEYS):
        return True
    names = [str(n) for n in hf.get("architectures") or []] + [str(v) for v in (hf.get("auto_map") or {}).values()]
    return any(d in n.lower() for n in names for d in _DIFFUSION_NAMES)


COMMIT_RULES = ("fast_dllm", "dynamic", "dream_reasoner", "llada")


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """How to decode. `None` fields take the model family's default.

    max_new_tokens: tokens to generate per prompt (block-causal families stop at EOS earlier).
    commit_rule: fast_dllm | dynamic (LLaDA2/SDAR) | dream_reasoner | llada.
    sub_block_size: Fast-dLLM v2 sub-block (8); other rules decode the whole block at once.
    steps_per_block: schedule length for dynamic/llada rules (default = block size).
    prefill_chunk: prompt tokens per prefill forward (block-causal families).
    max_prompt_len: prompts longer than this are an error (default: the model's max positions).
    prompt_refresh: bidirectional families: recompute the prompt K/V every N steps (0 = never).
    temperature / top_p / seed: sampling (temperature 0 = greedy).
    """

    max_new_tokens: int = 64
    block_size: Optional[int] = None
    commit_rule: Optional[str] = None
    threshold: Optional[float] = None
    sub_block_size: Optional[int] = None
    steps_per_block: Optional[int] = None
    prefill_chunk: int = 512
    max_prompt_len: Optional[int] = None
    prompt_refresh: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_at_eos: bool = True
    timings: bool = False

    def resolve(self, cfg: ModelConfig) -> "ResolvedGeneration":
        bs = self.block_size or cfg.block_size
        rule = self.commit_rule or cfg.commit_rule
        if rule not in COMMIT_RULES:
            raise ValueError(f"unknown commit_rule {rule!r}; choose one of {COMMIT_RULES}")
        sub = self.sub_block_size or (8 if rule == "fast_dllm" and bs % 8 == 0 else bs)
        if bs % sub:
            raise ValueError(f"block_size {bs} is not a multiple of sub_block_size {sub}")
        steps = self.steps_per_block or bs
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.prefill_chunk <= 0 or self.prefill_chunk % bs:
            raise ValueError(f"prefill_chunk {self.prefill_chunk} must be a positive multiple of block_size {bs}")
        return ResolvedGeneration(
            block_size=bs, sub_block_size=sub, commit_rule=rule,
            threshold=cfg.threshold if self.threshold is None else float(self.threshold),
            steps_per_block=steps, max_new_tokens=self.max_new_tokens,
            prefill_chunk=self.prefill_chunk,
            max_prompt_len=self.max_prompt_len or cfg.max_position_embeddings,
            prompt_refresh=self.prompt_refresh, temperature=float(self.temperature),
            top_p=float(self.top_p), stop_at_eos=self.stop_at_eos,
        )


@dataclasses.dataclass(frozen=True)
class ResolvedGeneration:
    """GenerationConfig with the family defaults filled in (static inside jit)."""

    block_size: int
    sub_block_size: int
    commit_rule: str
    threshold: float
    steps_per_block: int
    max_new_tokens: int
    prefill_chunk: int
    max_prompt_len: int
    prompt_refresh: int
    temperature: float
    top_p: float
    stop_at_eos: bool
