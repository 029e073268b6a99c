"""Attention ops: jnp references and Pallas kernels behind one dispatch.

    attention.attend                       the model's one entry point (GenerationConfig.attention)
    dispatch.scored_attention / scored_attention_quant / sparse_attention  (pick a kernel)
    reference.attention, quant_reference.attention_quant                   (jnp references)
    tpu (Pallas Mosaic TPU), gpu (Pallas Mosaic GPU, plgpu.kernel),
    gpu_triton (Pallas Triton: packed contexts on GPU)                     (imported lazily)
"""
from . import reference
from .dispatch import scored_attention, scored_attention_quant, sparse_attention

__all__ = ["reference", "scored_attention", "scored_attention_quant", "sparse_attention"]
