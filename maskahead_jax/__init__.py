"""maskahead_jax: mask-guided KV-cache eviction for block diffusion LMs in JAX."""
from .config import GenerationConfig, ModelConfig
from .api import Model, forward, load_pretrained

__all__ = ["GenerationConfig", "ModelConfig", "Model", "forward", "load_pretrained"]
