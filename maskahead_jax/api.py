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


def load_pretrained(path: str, dtype=None) -> Model:
    """Load an HF-layout folder (config.json + safetensors / torch .bin) or a converted orbax folder."""
    from converters.load import load_model  # converters live beside the package

    return load_model(path, dtype=dtype)


_forward_jit = jax.jit(forward_logits, static_argnames=("cfg", "attention"))


def forward(model: Model, tokens, attention: Optional[str] = None) -> jax.Array:
    """One full uncached forward; float32 logits [B, T, V] (no logit shift applied)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim == 1:
        tokens = tokens[None]
    return _forward_jit(model.params, model.config, tokens, attention=attention)
