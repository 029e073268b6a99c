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
    "testbed-released": (dict(), "the testbed's config.json decoding, every policy knob at its released "
                                 "default (floors 512 / 256, recent 64: long prompts need no scaling)"),
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


# ----------------------------------------------------------------------------- sweep presets
def parse_variant(label: str) -> tuple[str, dict]:
    """'q-maskahead[bits=2,compaction=lazy]' -> ('q-maskahead', {'bits': 2, 'compaction': 'lazy'});
    a plain name -> (name, {}). A variant is a registered policy with knobs fixed by its label,
    so one sweep can hold the same policy twice (rows are keyed by the label)."""
    from .policies import parse_policy_kw

    label = str(label).strip()
    if not label.endswith("]") or "[" not in label:
        if "[" in label or "]" in label:
            raise ValueError(f"bad policy variant {label!r}: expected name[knob=value,...]")
        return label, {}
    name, _, rest = label.partition("[")
    return name.strip(), parse_policy_kw(rest[:-1])


@dataclasses.dataclass(frozen=True)
class SweepPreset:
    """One reproducible policies x budgets sweep: its examples (testbed suite cells), decoding
    preset (whose policy knobs apply), policy labels (variants allowed), budgets and batch size.
    cells: ((tasks, length, n per (task, depth), dataset suffix), ...); a suffix names the cell's
    datasets apart ('passkey@4096') so they get their own column. score_datasets: the datasets
    the headline score (the suite mean) averages."""
    note: str
    preset: str
    cells: tuple
    depths: tuple
    policies: tuple
    capacities: tuple
    batch_size: int
    score_datasets: tuple
    seed: int = 0
    order: str = "capacity"  # run every policy at capacities[0] first (sweep._runs)


SUITE5 = ("passkey", "multikey", "twohop", "docqa", "longanswer")

SWEEPS: dict[str, SweepPreset] = {
    "testbed-policies": SweepPreset(
        note="docs/results.md §2: the five testbed tasks at 2048 tokens (+ passkey at 4096, the only "
             "cell where dense is above 0.7 at 4096), every released policy at 5/10/20%, testbed floors",
        preset="testbed",
        cells=((SUITE5, 2048, 2, ""), (("passkey",), 4096, 1, "@4096")),
        depths=(0.0, 0.25, 0.5, 0.75, 1.0),
        policies=("dense", "maskahead", "maskahead-bounded", "streaming", "h2o", "caote", "snapkv", "ea",
                  "dapq", "mage", "herald", "pyramidkv[block_causal=true]", "adakv[block_causal=true]",
                  "q-maskahead[bits=4]", "q-maskahead[bits=2]", "q-maskahead[bits=4,compaction=lazy]"),
        capacities=(10.0, 5.0, 20.0),
        batch_size=4,
        score_datasets=SUITE5),
    "testbed-low-bit": SweepPreset(
        note="docs/results.md §2: the baselines on the packed 4-bit cache (storage=Packed(4), issue 54), "
             "the same cells as testbed-policies, at 10%",
        preset="testbed",
        cells=((SUITE5, 2048, 2, ""), (("passkey",), 4096, 1, "@4096")),
        depths=(0.0, 0.25, 0.5, 0.75, 1.0),
        policies=("streaming[bits=4]", "h2o[bits=4]", "snapkv[bits=4]"),
        capacities=(10.0,),
        batch_size=4,
        score_datasets=SUITE5),
    "testbed-8192": SweepPreset(
        note="issue 53's headline table: the five testbed tasks at 8192 tokens with the released knobs "
             "unchanged; needs a model that runs 8192-token prompts (--model EXPORT, or the shipped "
             "testbed with --rope-scaling dynamic_yarn:16:2048)",
        preset="testbed-released",
        cells=((SUITE5, 8192, 2, ""),),  # 2 per (task, depth) x 5 depths x 5 tasks = 50 per run
        depths=(0.0, 0.25, 0.5, 0.75, 1.0),
        policies=("dense", "maskahead", "maskahead-bounded", "q-maskahead[bits=4]", "q-maskahead[bits=2]",
                  "q-maskahead-draft", "snapkv", "h2o", "streaming"),
        capacities=(10.0, 5.0, 20.0),
        batch_size=2,
        score_datasets=SUITE5),
}


def sweep_preset(name: str) -> SweepPreset:
    key = str(name).strip().lower()
    if key not in SWEEPS:
        raise ValueError(f"unknown sweep {name!r}; choose one of {sorted(SWEEPS)}")
    return SWEEPS[key]


def sweep_examples(sp: SweepPreset, tokenizer=None) -> list:
    """The examples of a sweep preset, cell by cell (datasets renamed by the cell's suffix)."""
    from .datasets import testbed_suite

    out = []
    for tasks, length, n, suffix in sp.cells:
        for e in testbed_suite(tasks, [length], sp.depths, n_per_cell=n, seed=sp.seed, tokenizer=tokenizer):
            if suffix:
                e = dataclasses.replace(e, dataset=e.dataset + suffix, id=e.dataset + suffix + e.id[len(e.dataset):])
            out.append(e)
    return out


def sweep_factory(sp: SweepPreset):
    """factory(label, capacity) for run_sweep: the label's policy with the preset's policy knobs
    (where the policy has them) and the variant's own knobs on top."""
    from .policies import knobs, make_policy

    floors = preset_policy_knobs(sp.preset)

    def factory(label, cap):
        name, vk = parse_variant(label)
        kw = {k: v for k, v in floors.items() if k in knobs(name)}
        kw.update(vk)
        return make_policy(name, cap, **kw)

    return factory
