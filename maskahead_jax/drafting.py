"""`generate` with a policy's drafted first pass: a wrapper that calls the engine twice.

A policy whose `draft_pass(max_new_tokens)` gives (n, first_policy) (issue 40's drafted probe,
`q-maskahead-draft`) is run as: the engine generates n tokens with `first_policy` (the same
policy without a draft), then the real run, whose hooks read those tokens as `ctx.draft`
(bounded prefill's question probe puts them in its answer blocks). The engine knows nothing of
this: it takes `draft=` as one more input. Every other policy goes straight to the engine.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Sequence

import numpy as np

from .config import GenerationConfig
from .engine.generate import BudgetWarning, generate as engine_generate
from .engine.stats import GenerateOutput
from .policies import Dense


def generate(model, prompts: Sequence[Sequence[int]], config: GenerationConfig = GenerationConfig(),
             policy=None, **kw) -> GenerateOutput:
    """Generate for a ragged batch of token-id prompts with a KV-cache policy (None = Dense).

    jit=False runs the very same functions eagerly (a plain-Python debug loop).
    cache_dtype defaults to the params' dtype.
    mesh: a jax.sharding.Mesh (see maskahead_jax.sharding.make_mesh, e.g. "data=2,model=4"):
    params / prompts are placed by the sharding rules and the same core runs under the mesh.
    A policy with a drafted first pass (`draft_pass`) runs twice (this module's docstring)."""
    policy = policy if policy is not None else Dense()
    first = policy.draft_pass(config.max_new_tokens)
    if first is None:
        return engine_generate(model, prompts, config, policy, **kw)
    cfg = model.config
    policy.check_run(cfg, config.resolve(cfg))  # refused before any pass runs
    note = policy.budget_note([len(p) for p in prompts])
    draft, first_out = _first_pass(model, prompts, config, first, note, **kw)
    out = engine_generate(model, prompts, config, policy, draft=draft, **kw)
    _add_draft_stats(out, first_out)
    return out


def _first_pass(model, prompts, config: GenerationConfig, first, run_note, **kw):
    """(n, policy) -> ([B, n] int32 drafted answers, mask id after each row's end, the first
    pass's GenerateOutput); the policy caps n (at the run's max_new_tokens unless it drafts past
    the answer). The first pass's warnings are passed on, except a BudgetWarning saying the run's
    own `run_note` (the same note twice); a first pass with a budget of its own keeps its own."""
    n, policy = first
    cfg = model.config
    if cfg.attention == "bidirectional":
        raise ValueError(f"{type(policy).__name__}: a drafted first pass (draft_pass) needs a "
                         f"block-causal model; {cfg.family} is bidirectional")
    if kw.get("mesh") is not None:
        raise ValueError("a drafted first pass (draft_pass) does not run under a device mesh yet")
    if n <= 0 or policy.draft_pass(n) is not None:
        raise ValueError(f"draft_pass must give n > 0 new tokens and a policy without a draft pass, "
                         f"got n={n}, {policy.draft_pass(n)}")
    with warnings.catch_warnings(record=True) as caught:  # the run warns of its own budget
        warnings.simplefilter("always")
        out = engine_generate(model, prompts, dataclasses.replace(config, max_new_tokens=n, timings=False),
                              policy, **kw)
    for w in caught:  # re-issued, but not a first-pass BudgetWarning the run will repeat
        if not (issubclass(w.category, BudgetWarning) and str(w.message) == run_note):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    arr = np.full((len(prompts), n), cfg.mask_token_id, np.int32)
    for i, row in enumerate(out.tokens):
        arr[i, :len(row)] = row[:n]
    return arr, out


def _add_draft_stats(out: GenerateOutput, first: GenerateOutput) -> None:
    """Count the first pass in the run's cost: its forwards and wall time are added, its peak
    bytes taken when higher (the passes run one after the other, so memory is their max)."""
    stats, fs = out.stats, first.stats
    stats["nfe"] = [a + b for a, b in zip(stats["nfe"], fs["nfe"])]
    stats["nfe_batch"] += fs["nfe_batch"]
    stats["tokens_per_forward"] = sum(map(len, out.tokens)) / max(1, stats["nfe_batch"])
    stats["wall_s"] += fs["wall_s"]
    peak = [max(a, b) for a, b in zip(stats["kv_bytes_peak"], fs["kv_bytes_peak"])]
    stats["kv_bytes_peak"] = peak
    stats["reduction_peak"] = [d / max(p, 1.0) for d, p in zip(stats["dense_bytes_peak"], peak)]
    stats["draft"] = dict(tokens=[len(t) for t in first.tokens], nfe=fs["nfe"],
                          nfe_batch=fs["nfe_batch"], wall_s=fs["wall_s"])
