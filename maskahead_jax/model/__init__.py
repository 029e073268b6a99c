"""The transformer as pure functions over a params pytree, and `Model` (config + params)."""
from .container import Model
from .decoder import (Context, Segment, StepOutput, block_causal_mask, embed, forward_hidden,
                      forward_logits, full_mask, lm_head, model_step, run_layers)
from .init import init_params, param_shapes
from .layers import apply_rope, rms_norm, rope_tables, swiglu
from .moe import moe_mlp, route
from .stats import StatsRequest
