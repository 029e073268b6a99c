"""From the core's device results to tokens per prompt and the `stats` dict users read."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass
class GenerateOutput:
    """tokens: generated ids per prompt (cut before the first EOS); stats: see `finish`."""

    tokens: list[list[int]]
    stats: dict[str, Any]


class NonFiniteLogitsError(ValueError):
    """A run's logits were NaN or infinite (a broken checkpoint, an impossible config): generate
    stops instead of returning mask ids as answers (docs/evaluation.md)."""


def finish(res, prompts, cfg, gen, wall, policy) -> GenerateOutput:
    """Cut each row's generated tokens (after its prompt tail, at EOS) and build the stats:
    forwards (per row and batch), KV bytes held vs a bf16 cache of every seen token (final and
    peak), their ratio, live entries and their share of the tokens seen (kept_pct: the budget in
    effect, floors included), the cache's capacity, evictions and blocks run, and the policy's
    note when a floor overrode the requested budget."""
    bad = np.flatnonzero(np.asarray(res.get("nonfinite", False)))
    if bad.size:
        raise NonFiniteLogitsError(
            f"the model produced NaN / inf logits (rows {bad.tolist()} of {len(prompts)}): its answers would be "
            f"meaningless; check the checkpoint's weights and its RoPE / norm settings")
    eos = set(cfg.eos_token_ids)
    toks = []
    n_gen = 0
    for i, p in enumerate(prompts):
        off = len(p) - int(res["first_pos"][i])  # generated tokens start after the prompt tail
        row = [int(t) for t in res["out"][i, off:off + gen.max_new_tokens]]
        if gen.stop_at_eos:
            for j, t in enumerate(row):
                if t in eos:
                    row = row[:j]
                    break
        n_gen += len(row)
        toks.append(row)
    kvb, dense = res["kv_bytes"], res["dense_bytes"]
    stats = dict(
        policy=policy.label,
        nfe=res["nfe"].tolist(), nfe_batch=int(res["nfe_batch"]),
        tokens_per_forward=n_gen / max(1, int(res["nfe_batch"])),
        kv_bytes_final=kvb.tolist(), kv_bytes_peak=res["kv_peak"].tolist(),
        dense_bytes_final=dense.tolist(), dense_bytes_peak=res["dense_peak"].tolist(),
        reduction_final=(dense / np.maximum(kvb, 1)).tolist(),
        reduction_peak=(res["dense_peak"] / np.maximum(res["kv_peak"], 1)).tolist(),
        live_entries=res["live"].tolist(),
        kept_pct=(100.0 * res["live"] / np.maximum(res["seen"], 1)).tolist(),
        budget_note=policy.budget_note([len(p) for p in prompts]),
        cache_capacity=int(res["capacity"]),
        evictions=int(res["evictions"]), blocks=int(res["blocks"]), wall_s=wall,
    )
    return GenerateOutput(tokens=toks, stats=stats)
