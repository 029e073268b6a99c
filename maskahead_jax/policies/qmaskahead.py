"""The low-bit presets: MaskAhead and its question-aware variants on the packed cache.

Q-MaskAhead is MaskAhead with `storage=Packed(4)` (policies/storage.py; research/maskahead.md
section 4): selection and eviction are MaskAhead's, only where the entries live differs:

* committed blocks (and prefill chunks) are produced in the forward's dtype and quantized once on
  append (KIVI: keys per channel over 32 tokens, values per token over 32 channels, fp16 metadata);
* the step-0 scored pass (output, prefix mass, value score), the eviction probe and the dense
  layers read the packed cache, dequantized inside each layer's body;
* the selected entries are gathered and dequantized into a compact `compact_dtype` (bf16) buffer
  that the later steps and the commit forward read;
* eviction ranks by A_i * ||v_i - c|| with v the dequantized values, and requantizes the
  survivors' keys into fresh groups (cache/packed_layout.requantize_survivors: the documented
  deviation); compaction="lazy" is the released default (docs/quantization.md).

The same storage composes with every policy (`make("snapkv", 10, bits=4)`); the presets below
are the ones with names of their own:

  q-maskahead        MaskAhead + Packed(4)
  bitsieve-v1        released configs/bitsieve_v1.yaml: the K4V4 cache with selection by the
                     step-0 mass alone and no eviction (MaskAhead(select_ranking="mass",
                     evict_ranking="none") + Packed(4))
  q-maskahead-qa     ours (issue 40): maskahead-qa's eviction over the packed cache with AdaKV's
                     head budgets (92.0 against 90.9 at 10%, 13 / 4, p = 0.05; 94.8 against 94.8
                     at 20% on the testbed suite): the question-aware ranking decides what is
                     kept, the low-bit storage makes each kept entry 2.6x (head_dim 32) to ~3.5x
                     (128) cheaper
  q-maskahead-draft  DraftedMaskAhead + Packed(4) + AdaKV's head budgets (issue 40's best row)
"""
from __future__ import annotations

import dataclasses

from .maskahead import QuestionAwareMaskAhead
from .storage import Packed

PACKED4 = Packed(4)


@dataclasses.dataclass(frozen=True)
class DraftedMaskAhead(QuestionAwareMaskAhead):
    """`maskahead-qa` with the drafted probe and max-pooled question rows (ours, issue 40's best
    row, docs/results.md §2): generate first runs the policy without a draft for draft_tokens
    new tokens (at most the run's max_new_tokens), and bounded prefill's question probe then reads
    that answer instead of mask blocks, its rows pooled by mean + max. The same memory as
    maskahead-qa (each pass is bounded); about twice the forwards (a second prefill and the
    drafted tokens); with attention kernels the probe forwards pool by mean + max in the kernels'
    statistics pass. 96 = three blocks of 32 (the testbed's and Fast-dLLM v2's block size)."""

    name = "maskahead-draft"
    draft_tokens: int = 96
    question_pool: str = "mean+max"

