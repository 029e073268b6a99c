"""What a forward reports besides its hidden states: one request, answered by the model.

A policy says what it reads from a forward in one `StatsRequest` (the step-0 forward of a block,
a prefill chunk, a probe): which query rows the statistics pool over, and which statistics.
The model answers it layer by layer (`model_step(..., stats=request)`): the prefix mass and the
value score come out of the attention itself (the Pallas kernels' statistics pass where the
kernels run, pooled there by every rule in `POOLS`), the query moments from the layer's
pre-RoPE projection, the block's own K/V from what the forward stores anyway.
"""
from __future__ import annotations

from typing import NamedTuple

import jax


class StatsRequest(NamedTuple):
    """One forward's statistics, as a policy asks for them.

    rows      [B, T] bool: the block's queries the statistics pool over
    mass      each cache entry's prefix-only softmax mass and value-aware score, pooled over
              `rows` and the GQA group by `pool` (StepOutput.mass / .score; ctx.mass / ctx.score)
    pool      how the rows pool: "mean" (each key's share of the rows' attention), "max",
              "mean+max", "max_joint" (kernels.reference.POOLS / pool_rows; `attend` refuses
              any other)
    moments   the rows' pre-RoPE query moments per query head (StepOutput.queries; ctx.queries,
              with ctx.rope: the RoPE phase at the forward's last two positions)
    block_kv  the block's own post-RoPE K/V at step 0 (ctx.block_kv: a joint-softmax vote over
              [cache | block], MaskKV on block-causal models)
    """

    rows: jax.Array
    mass: bool = True
    pool: str = "mean"
    moments: bool = False
    block_kv: bool = False
