"""Model and generation configuration: frozen, hashable dataclasses.

ModelConfig: the architecture and the block-diffusion behaviour of one model (static jit arg).
FAMILY_DEFAULTS: each supported family's block-diffusion defaults, as a `FamilyDefaults` record.
GenerationConfig / ResolvedGeneration: how to decode; `None` fields resolve to the model's values.

Reading a Hugging Face `config.json` into a ModelConfig is the converters' job
(`converters.hf_config.model_config_from_hf`); this module imports nothing of them.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import NamedTuple, Optional

import numpy as np


class FamilyDefaults(NamedTuple):
    """A family's block-diffusion defaults (what its config.json leaves unsaid)."""

    attention: str  # bidirectional | block_causal
    logits_shift: bool  # token j is predicted by the output at j - 1 (AR-initialised families)
    commit_rule: str  # one of COMMIT_RULES
    mask_token_id: int
    eos_token_ids: tuple[int, ...]
    threshold: float  # confidence threshold of the commit rule


FAMILY_DEFAULTS: dict[str, FamilyDefaults] = {
    "fast_dllm_v2": FamilyDefaults("block_causal", True, "fast_dllm", 151665, (151645,), 0.9),
    "dream": FamilyDefaults("bidirectional", True, "llada", 151666, (151643,), 0.9),
    "sdar": FamilyDefaults("block_causal", False, "dynamic", 151669, (151643, 151645), 0.85),
    "dream_reasoner": FamilyDefaults("block_causal", False, "dream_reasoner", 151669, (151643, 151645), 0.9),
    "llada": FamilyDefaults("bidirectional", False, "llada", 126336, (126081, 126348), 0.9),
    "llada2": FamilyDefaults("block_causal", False, "dynamic", 156895, (156892,), 0.95),
}

ATTENTION_KINDS = ("bidirectional", "block_causal")


class ConfigError(ValueError):
    """A model config this library cannot run (unknown model_type or family, bad field)."""


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
    rope_scaling: Optional["RopeScaling"] = None  # maskahead_jax.model.rope.RopeScaling; None = plain RoPE

    def __post_init__(self):
        if self.attention not in ATTENTION_KINDS:
            raise ConfigError(f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ConfigError(f"rotary_dim={self.rotary_dim} must be even and <= head_dim")
        if isinstance(self.rope_theta, bool) or not isinstance(self.rope_theta, (int, float)) \
                or not 0 < self.rope_theta < float("inf"):
            raise ConfigError(f"rope_theta must be a positive number, got {self.rope_theta!r}")
        s = self.rope_scaling
        if s is not None and s.type == "longrope" and len(s.short_factor) != self.rope_dim // 2:
            raise ConfigError(f"rope_scaling (longrope): short_factor / long_factor need {self.rope_dim // 2} "
                              f"entries (rotary dim / 2), got {len(s.short_factor)}")
        if self.vocab_size is None or self.vocab_size < 1:
            raise ConfigError(f"vocab_size must be a positive integer, got {self.vocab_size!r}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"mask_token_id={self.mask_token_id} is not a token of the vocabulary "
                              f"[0, vocab_size={self.vocab_size})")
        for name in ("block_size", "threshold", "commit_rule"):  # the decoding defaults: GenerationConfig's check
            check_generation_field(name, getattr(self, name), "model config", optional=False)

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


COMMIT_RULES = ("fast_dllm", "dynamic", "dream_reasoner", "llada")


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(float(v))


# the one check of every decoding setting, whatever the entry: GenerationConfig (Python, the CLI's
# flags, presets) and a model's config.json defaults (ModelConfig's block_size / threshold /
# commit_rule). Each: (accepts the value, what is expected); None is "the model's default".
_GEN_FIELDS = {
    "max_new_tokens": (lambda v: _is_int(v) and v > 0, "a positive integer"),
    "block_size": (lambda v: _is_int(v) and v > 0, "a positive integer"),
    "commit_rule": (lambda v: v in COMMIT_RULES, f"one of {', '.join(COMMIT_RULES)}"),
    "threshold": (lambda v: _is_real(v) and 0.0 < float(v) <= 1.0, "a commit threshold in (0, 1]"),
    "sub_block_size": (lambda v: _is_int(v) and v > 0, "a positive integer"),
    "steps_per_block": (lambda v: _is_int(v) and v > 0, "a positive integer"),
    "prefill_chunk": (lambda v: _is_int(v) and v > 0, "a positive integer"),
    "max_prompt_len": (lambda v: _is_int(v) and v > 0, "a positive integer"),
    "prompt_refresh": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "temperature": (lambda v: _is_real(v) and float(v) >= 0.0, "a finite number >= 0"),
    "top_p": (lambda v: _is_real(v) and 0.0 < float(v) <= 1.0, "a number in (0, 1]"),
    "seed": (_is_int, "an integer"),
    "stop_at_eos": (lambda v: isinstance(v, (bool, np.bool_)), "True or False"),
    "timings": (lambda v: isinstance(v, (bool, np.bool_)), "True or False"),
    "attention": (lambda v: isinstance(v, str) and v != "", "an attention implementation name"),
    "attention_interpret": (lambda v: isinstance(v, (bool, np.bool_)), "True or False"),
}
_GEN_OPTIONAL = {"block_size", "commit_rule", "threshold", "sub_block_size", "steps_per_block", "max_prompt_len"}


def check_generation_field(name: str, value, where: str = "GenerationConfig", optional: bool = True) -> None:
    """ConfigError (a ValueError) naming `where`, the field and the value unless `value` is a
    valid `name` of a GenerationConfig (None: the model's default, where the field has one and
    `optional`)."""
    if value is None and optional and name in _GEN_OPTIONAL:
        return
    ok, expected = _GEN_FIELDS[name]
    try:
        good = bool(ok(value))
    except (TypeError, ValueError):
        good = False
    if not good:
        raise ConfigError(f"{where}: {name} must be {expected}, got {value!r}")


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
    attention: "auto" (Pallas kernels on GPU / TPU, the jnp reference on CPU), "reference",
        "kernels", or one kernel backend by name ("pallas_gpu", "pallas_triton", "pallas_tpu"); see
        maskahead_jax/kernels/attention.py.
    attention_interpret: run the chosen Pallas kernels in interpret mode (tests, CPU debugging).
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
    attention: str = "auto"
    attention_interpret: bool = False

    def __post_init__(self):
        for f in dataclasses.fields(self):
            check_generation_field(f.name, getattr(self, f.name))
        if self.block_size is not None and self.prefill_chunk % self.block_size:
            raise ConfigError(f"GenerationConfig: prefill_chunk {self.prefill_chunk} must be a positive "
                              f"multiple of block_size {self.block_size}")

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
            attention=self.attention, attention_interpret=bool(self.attention_interpret),
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
    attention: str = "auto"  # as asked; the engine resolves it per backend (kernels.attention)
    attention_interpret: bool = False
