"""Public entry points: Model, load_pretrained, forward."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from .model import forward_logits
from .model.container import Model  # re-exported: maskahead_jax.api.Model / maskahead_jax.Model

__all__ = ["Model", "forward", "load_pretrained"]


def load_pretrained(path: str, dtype=None, family: Optional[str] = None) -> Model:
    """Load an HF-layout folder (config.json + safetensors / torch .bin) or a converted orbax folder.

    family: force the model family (fast_dllm_v2, dream, sdar, dream_reasoner, llada, llada2)
    instead of the one config.json implies; a qwen2 / qwen3 config without a block-diffusion
    marker is a plain autoregressive model and is refused unless a family is forced."""
    # converters sit above the library (they import it); import them only when called, so that
    # importing maskahead_jax never imports converters
    from converters.load import load_model

    return load_model(path, dtype=dtype, family=family)


_forward_jit = jax.jit(forward_logits, static_argnames=("cfg", "attention"))


def forward(model: Model, tokens, attention: Optional[str] = None) -> jax.Array:
    """One full uncached forward; float32 logits [B, T, V] (no logit shift applied)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim == 1:
        tokens = tokens[None]
    return _forward_jit(model.params, model.config, tokens, attention=attention)
