"""The KV cache as the engine accounts it, without running it: per-row bytes over a run's
schedule (`kv_accounting`, checked against generate's stats in tests/test_lowering.py) and the
per-device bytes of a policy's static cache buffers (`cache_buffers`). Inputs of the memory plan."""
from __future__ import annotations

import math

def _bytes_per_token(policy, cfg, dtype="bfloat16") -> float:
    """The policy's cache format's bytes per token per (layer, KV head) (`cache.bytes_per_token`,
    read from a small concrete empty cache of the same format)."""
    import jax.numpy as jnp

    return float(policy.empty_cache(1, 1, 1, 64, cfg.head_dim, jnp.dtype(dtype), group_size=cfg.group_size).bytes_per_token)


def _for_run(policy, cfg, gen):
    """The policy as the block-causal core runs it (its automatic knobs fixed: Policy.for_run)."""
    return policy.for_run(cfg, gen) if cfg.attention != "bidirectional" and hasattr(policy, "for_run") else policy


def _schedule_kind(policy) -> str:
    """"dense" | "evict" (deferred evictions of a composed policy) | "maskkv"; NotImplementedError
    for the policies whose schedule the plan does not model."""
    from ..policies import ComposedPolicy, Dense, MaskKV

    if type(policy) is Dense:
        return "dense"
    if isinstance(policy, MaskKV) and policy.voters == "mask" and not policy.block_causal:
        return "maskkv"
    if isinstance(policy, ComposedPolicy) and policy.draft_pass(None) is None \
            and getattr(policy.storage, "compaction", "requantize") == "requantize" \
            and not getattr(policy.storage, "residual", False):
        ev = policy.eviction
        if ev is None:
            return "dense"
        if ev.deferred and not ev.bounded_prefill and not ev.allocation.ragged:
            return "evict"
    raise NotImplementedError(f"the memory plan does not model {policy.label}'s schedule "
                              f"(dense, maskahead, q-maskahead and maskkv only)")


def kv_accounting(cfg, gen, policy, prompt_len: int, cache_dtype="bfloat16") -> dict:
    """Per-row KV bytes of one prompt of `prompt_len` tokens decoding gen.max_new_tokens (no EOS)
    as the engine accounts them (memory.row_bytes through policy.held_bytes): `dense` (bf16 of
    every token seen, at the end), `peak` (and its parts: `peak_prefill` in the prefill buffer,
    `peak_decode` in the decode buffer), `end`, and entries per lane at the end. Follows the
    engine's schedule: the block-aligned prompt prefix stored by prefill, deferred evictions to
    C(seen) at step 0 of a block (after the prompt and every interval_blocks blocks), each block
    appended whole; MaskKV: the prompt cut to its per-head budgets (an upper bound: head budgets
    clipped at the prompt length keep less), peak with one layer's whole prompt (layer by layer)
    or every layer's (online). tests/test_lowering.py checks it against generate's stats."""
    from ..memory import EVICTION_STATE_BYTES

    policy = _for_run(policy, cfg, gen)
    kind = _schedule_kind(policy)
    L, H, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    bpt = _bytes_per_token(policy, cfg, cache_dtype)
    lanes = L * H
    bf16 = 4.0 * D  # memory.bf16_dense_bytes per token per lane
    p, bs = int(prompt_len), gen.block_size
    if cfg.attention == "bidirectional":
        full = p * lanes * bpt
        if kind == "dense":
            return dict(dense=p * lanes * bf16, peak=full, peak_prefill=full, peak_decode=full, end=full, entries=p)
        if kind != "maskkv":
            raise NotImplementedError(f"the memory plan does not model {policy.label} on a bidirectional model")
        kept = min(policy.per_head_budget(p), p)
        end = kept * lanes * bpt
        peak = end + p * H * bpt if policy.prompt_layerwise else max(end, full)
        return dict(dense=p * lanes * bf16, peak=peak, peak_prefill=peak, peak_decode=end, end=end, entries=kept)
    if kind == "maskkv":
        raise NotImplementedError("the memory plan does not model maskkv-blockcausal")
    state = EVICTION_STATE_BYTES if policy.keeps_state else 0.0
    held = lambda n: n * lanes * (bpt + state)  # noqa: E731  (compacted lanes: extent = kept)
    ev = policy.eviction if kind == "evict" else None
    cap = ev.budget.capacity if ev is not None else None
    length = seen = (p // bs) * bs
    peak_prefill, peak = held(length), 0.0
    due = ev is not None and length > cap(seen)
    nblk = math.ceil((bs - 1 + gen.max_new_tokens) / bs)
    blocks = max(1, min(nblk, math.ceil((p + gen.max_new_tokens - seen) / bs)))
    for j in range(blocks):
        if due:
            length = min(length, cap(seen))
        length, seen = length + bs, seen + bs
        peak = max(peak, held(length))
        due = (ev is not None and bool(ev.interval_blocks) and (j + 1) % ev.interval_blocks == 0
               and length > cap(seen) and j < blocks - 1)
    return dict(dense=seen * lanes * bf16, peak=max(peak_prefill, peak), peak_prefill=peak_prefill,
                peak_decode=peak, end=held(length), entries=length)


def cache_buffers(cfg, gen, policy, prompt_len: int, batch: int, mesh) -> dict:
    """Per-device bytes of the policy's static cache buffers ({"prefill": .., "decode": ..}): the
    capacities of its `plan` (block-causal) / the prompt buffer and MaskKV's buffer_size
    (bidirectional), `empty_cache` evaluated abstractly, laid out by the cache rules on `mesh`."""
    import jax
    import jax.numpy as jnp

    from ..axes import cache_spec
    from ..engine.generate import prompt_bucket
    from ..sharding import shard_shape

    policy = _for_run(policy, cfg, gen)
    L, H, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    pb = prompt_bucket(prompt_len, max(64, gen.block_size))
    bs, chunk = gen.block_size, gen.prefill_chunk
    if cfg.attention == "bidirectional":
        cap1 = policy.buffer_size(pb, L, H) if _schedule_kind(policy) == "maskkv" else pb
        caps = dict(prefill=pb, decode=cap1)
    else:
        nblk = math.ceil((bs - 1 + gen.max_new_tokens) / bs)
        prompt_cap = max(1, math.ceil(pb / chunk)) * chunk
        total_cap = max(prompt_cap, pb + (nblk + 1) * bs)
        c0, c1 = policy.plan(prompt_cap, total_cap, bs, chunk)
        caps = dict(prefill=c0, decode=c1)

    def per_device(cap):
        tree = jax.eval_shape(lambda: policy.empty_cache(L, batch, H, cap, D, jnp.bfloat16, group_size=cfg.group_size))
        return sum(math.prod(shard_shape(a.shape, cache_spec(a.shape, mesh), mesh)) * a.dtype.itemsize
                   for a in jax.tree_util.tree_leaves(tree))

    return {k: int(per_device(c)) for k, c in caps.items()} | {f"{k}_slots": int(c) for k, c in caps.items()}
