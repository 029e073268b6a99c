"""Public entry points: Model, load_pretrained, forward."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from .config import ModelConfig
from .model import forward_logits


@dataclasses.dataclass
class Model:
    """A config plus its params pytree."""

    config: ModelConfig
    params: Any

    def astype(self, dtype) -> "Model":
        return Model(self.config, jax.tree_util.tree_map(lambda a: a.astype(dtype), self.params))


def load_pretrained(path: str, dtype=None, family: Optional[str] = None) -> Model:
    """Load an HF-layout folder (config.json + safetensors / torch .bin) or a converted orbax folder.

    family: force the model family (fast_dllm_v2, dream, sdar, dream_reasoner, llada, llada2)
    instead of the one config.json implies; a qwen2 / qwen3 config without a block-diffusion
    marker is a plain autoregressive model and is refused unless a family is forced."""
    from converters.load import load_model  # converters live beside the package

    return load_model(path, dtype=dtype, family=family)


_forward_jit = jax.jit(forward_logits, static_argnames=("cfg", "attention"))


def forward(model: Model, tokens, attention: Optional[str] = None) -> jax.Array:
    """One full uncached forward; float32 logits [B, T, V] (no logit shift applied)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim == 1:
        tokens = tokens[None]
    return _forward_jit(model.params, model.config, tokens, attention=attention)
