"""Public entry points: Model, load_pretrained, model_folder, forward."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import numerics
from .model import forward_logits
from .model.container import Model  # re-exported: maskahead_jax.api.Model / maskahead_jax.Model

__all__ = ["Model", "forward", "load_pretrained", "model_folder"]


def model_folder(path: str) -> str:
    """The local folder of a model: `path` itself when it exists (a local path always wins), else
    the snapshot folder of the Hugging Face hub id `path` ("org/name") in the Hugging Face cache,
    downloaded when the hub is reachable, read offline from the cache otherwise (HF_HOME,
    HF_HUB_CACHE, HF_HUB_OFFLINE respected). E.g. `load_tokenizer(model_folder("org/name"))`."""
    from converters.load import resolve_model_path

    return resolve_model_path(path)


def load_pretrained(path: str, dtype=None, family: Optional[str] = None, *, rope_theta: Optional[float] = None,
                    rope_scaling=None, max_position_embeddings: Optional[int] = None) -> Model:
    """Load an HF-layout folder (config.json + safetensors / torch .bin) or a converted orbax folder,
    or a Hugging Face hub id such as "Efficient-Large-Model/Fast_dLLM_v2_7B" (`model_folder`:
    through the Hugging Face cache; no code from the repository is downloaded or run).

    family: force the model family (fast_dllm_v2, dream, sdar, dream_reasoner, llada, llada2)
    instead of the one config.json implies; a qwen2 / qwen3 config without a block-diffusion
    marker is a plain autoregressive model and is refused unless a family is forced.

    dtype: a float dtype (float32, bfloat16, float16); None keeps the checkpoint's.
    rope_theta: replace config.json's RoPE base (LongLLaDA's recipe: multiply it by 4-55 for LLaDA-8B).
    rope_scaling: replace config.json's RoPE scaling: "yarn:4", "linear:2", "dynamic:2", "llama3:8"
    (TYPE:FACTOR[:ORIGINAL_LENGTH]; the original length defaults to the checkpoint's), an HF-style
    dict, or "none"; it raises max_position_embeddings to factor x original length.
    max_position_embeddings: the positions the engine allows, set outright (docs/long_context.md)."""
    # converters sit above the library (they import it); import them only when called, so that
    # importing maskahead_jax never imports converters
    from converters.load import load_model

    return load_model(path, dtype=dtype, family=family, rope_theta=rope_theta, rope_scaling=rope_scaling,
                      max_position_embeddings=max_position_embeddings)


_forward_jit = numerics.jit(forward_logits, static_argnames=("cfg", "attention"))


def forward(model: Model, tokens, attention: Optional[str] = None) -> jax.Array:
    """One full uncached forward; float32 logits [B, T, V] (no logit shift applied).
    tokens: [T] or [B, T] integer token ids in [0, vocab_size) (as `generate` checks them)."""
    if not isinstance(tokens, jax.core.Tracer):  # host values: checked as generate checks them
        arr = np.asarray(tokens)
        if arr.dtype == object or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
            raise TypeError(f"tokens must be integer token ids ([T] or [B, T]), got {arr.dtype} values")
        if arr.ndim not in (1, 2) or arr.size == 0:
            raise ValueError(f"tokens must be a non-empty [T] or [B, T] array of token ids, got shape {arr.shape}")
        v = model.config.vocab_size
        bad = arr[(arr < 0) | (arr >= v)]
        if bad.size:
            raise ValueError(f"tokens has ids outside [0, {v}): {bad[:5].tolist()}")
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim == 1:
        tokens = tokens[None]
    return _forward_jit(model.params, model.config, tokens, attention=attention)
