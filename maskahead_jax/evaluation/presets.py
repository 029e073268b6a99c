"""Decoding presets of the papers' settings (research/maskahead.md §6, research/models.md),
as GenerationConfig builders by name."""
from __future__ import annotations

import dataclasses

from ..config import GenerationConfig

# name -> (GenerationConfig fields, note)
PRESETS: dict[str, tuple[dict, str]] = {
    "fast-dllm-v2": (dict(block_size=32, sub_block_size=8, threshold=0.95, commit_rule="fast_dllm"),
                     "Fast-dLLM v2 7B: block 32, sub-block 8, threshold 0.95, greedy"),
    "dream-reasoner": (dict(block_size=32, threshold=0.9, steps_per_block=32, commit_rule="dream_reasoner"),
                       "DreamReasoner-8B: low-confidence dynamic, threshold 0.9, 32 steps/block, greedy"),
    "sdar": (dict(block_size=32, threshold=0.85, commit_rule="dynamic"),
             "SDAR-8B-Chat-b32: threshold 0.85, greedy"),
    "llada2-mini": (dict(block_size=32, threshold=0.95, commit_rule="dynamic"),
                    "LLaDA2.0-mini: threshold 0.95, greedy"),
    "llada": (dict(block_size=32, steps_per_block=32, commit_rule="llada"),
              "LLaDA-8B: semi-autoregressive blocks of 32, one token per step (steps = gen length)"),
    "dream": (dict(block_size=32, steps_per_block=32, commit_rule="llada"),
              "Dream-v0-7B: blocks of 32, one token per step"),
    "testbed": (dict(), "the shipped testbed model: its config.json defaults (threshold 0.95, dynamic)"),
}

# policy knobs a preset brings (each applies to the policies that have it; --policy-kw overrides):
# the released floors (capacity 512 / top-k 256) exceed 10% of the testbed's 512-2048-token
# prompts, so the testbed preset scales them as docs/results.md §2 does
POLICY_KNOBS: dict[str, dict] = {
    "testbed": dict(capacity_floor=64, topk_floor=32, recent=32),
}

ALIASES = {"fast_dllm_v2": "fast-dllm-v2", "fastdllm": "fast-dllm-v2", "dreamreasoner": "dream-reasoner",
           "dream_reasoner": "dream-reasoner", "llada2": "llada2-mini", "llada2.0-mini": "llada2-mini",
           "llada2_mini": "llada2-mini"}


def preset_policy_knobs(name: str | None) -> dict:
    """The policy knobs a preset carries ({} for none)."""
    if not name:
        return {}
    return dict(POLICY_KNOBS.get(ALIASES.get(name.lower(), name.lower()), {}))


def preset_config(name: str | None = None, max_new_tokens: int = 64, **overrides) -> GenerationConfig:
    """GenerationConfig of a named preset (None / "testbed" = the model's family defaults).

    `overrides` replace preset fields (e.g. threshold=0.9, stop_at_eos=False)."""
    kw: dict = {}
    if name:
        key = ALIASES.get(name.lower(), name.lower())
        if key not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        kw.update(PRESETS[key][0])
    kw["max_new_tokens"] = int(max_new_tokens)
    kw.update({k: v for k, v in overrides.items() if v is not None})
    fields = {f.name for f in dataclasses.fields(GenerationConfig)}
    bad = set(kw) - fields
    if bad:
        raise ValueError(f"unknown GenerationConfig fields {sorted(bad)}")
    return GenerationConfig(**kw)
