"""KV-cache policies: frozen, hashable dataclasses passed to `generate(..., policy=...)`.

The protocol the engine calls is in protocol.py; most policies compose a selection part
(selection.py) and an eviction part (eviction.py: budget, schedule, forced keeps, a scorer from
scorers.py, a probe from probes.py) through composed.py. `make(name, capacity_pct=None,
**knobs)` builds one by name from the one registry (registry.py); `register` adds yours
(docs/extending.md).
"""
from .protocol import BlockResult, Dense, Policy, PolicyError, StatsRequest, StepContext
from .registry import knobs, make, names, register, takes_budget
from .composed import ComposedPolicy
from .maskahead import BoundedPrefillMaskAhead, DapQ, MaskAhead, QuestionAwareMaskAhead
from .qmaskahead import PACKED4, DraftedMaskAhead
from .storage import Float, Packed
from .baselines import CAOTE, H2O, HERALD, BoundedPrefillStreamingLLM, SnapKV, StreamingLLM
from .expected_attention import ExpectedAttention
from .maskkv import AdaKV, MaskKV, PyramidKV


register("dense", Dense, budget_field=None)
register("maskahead", MaskAhead)
register("maskahead-noevict", MaskAhead, evict_ranking="none")
register("mage", MaskAhead, select_ranking="mass", evict_ranking="none")
register("maskahead-bounded", BoundedPrefillMaskAhead)
register("maskahead-qa", QuestionAwareMaskAhead)
# the low-bit presets (policies/qmaskahead.py): any policy takes storage=Packed(bits) (bits=4)
register("q-maskahead", MaskAhead, defaults=dict(storage=PACKED4))
register("q-maskahead-qa", QuestionAwareMaskAhead, defaults=dict(storage=PACKED4, head_alloc="adakv"))
register("q-maskahead-draft", DraftedMaskAhead, defaults=dict(storage=PACKED4, head_alloc="adakv"))
register("bitsieve-v1", MaskAhead, defaults=dict(storage=PACKED4), select_ranking="mass", evict_ranking="none")
register("streaming", StreamingLLM)
register("streaming-bounded", BoundedPrefillStreamingLLM)
register("h2o", H2O)
register("caote", CAOTE)
register("snapkv", SnapKV)
register("ea", ExpectedAttention)
register("dapq", DapQ)
register("herald", HERALD)
register("maskkv", MaskKV, budget_field="budget_pct", entries_field="budget_per_head")
register("maskkv-online", MaskKV, budget_field="budget_pct", entries_field="budget_per_head", layerwise=False)
register("maskkv-blockcausal", MaskKV, budget_field="budget_pct", entries_field="budget_per_head", block_causal=True)
register("pyramidkv", PyramidKV, budget_field="budget_pct", entries_field="budget_per_head")
register("adakv", AdaKV, budget_field="budget_pct", entries_field="budget_per_head")

__all__ = ["AdaKV", "BlockResult", "BoundedPrefillMaskAhead", "BoundedPrefillStreamingLLM", "CAOTE", "DraftedMaskAhead", "Float", "Packed",
           "ComposedPolicy", "DapQ", "Dense", "ExpectedAttention", "H2O", "HERALD", "MaskAhead", "MaskKV", "Policy", "PolicyError",
           "PyramidKV", "QuestionAwareMaskAhead", "SnapKV", "StatsRequest", "StepContext", "StreamingLLM", "knobs", "make", "names",
           "register", "takes_budget"]
