"""maskahead_jax: mask-guided KV-cache eviction for block diffusion LMs in JAX.

Public API (shared/DESIGN.md §3): load_pretrained, forward, generate, GenerationConfig,
ModelConfig, Model, load_tokenizer, and the policies in `maskahead_jax.policies`.
"""
from .config import GenerationConfig, ModelConfig
from .api import Model, forward, load_pretrained
from .generate import GenerateOutput, generate  # noqa: E402  (the function shadows the submodule name)
from .evaluation.datasets import load_tokenizer

__all__ = ["GenerateOutput", "GenerationConfig", "ModelConfig", "Model", "forward", "generate",
           "load_pretrained", "load_tokenizer"]
