"""MaskAhead: the mask queries choose what a block reads (selection) and what the cache keeps
(eviction, with a lookahead probe of upcoming mask blocks). research/maskahead.md §2-§3, §5.

Selection (every block, step 0): per (layer >= dense_layers, batch, KV head) rank live entries
by s_i = a_i * ||v_i - c|| (a = prefix-only softmax mass pooled over the block's masked queries
and the GQA group, c = sum a_i v_i), keep the top k = min(live, max(topk_floor,
ceil(topk_pct% * live))), gather them once and reuse them for all later steps and the commit.

Eviction (deferred to step 0 of the block after every `interval_blocks` blocks, and after the
prompt): capacity C = max(floor(capacity_pct% * seen), capacity_floor); a probe forward of the
step-0 block plus lookahead_blocks - 1 mask blocks adds its mass to the step-0 mass (A); keep the
`recent` newest entries, positions < `sinks`, and the top C - recent by A_i * ||v_i - c'||;
survivors are compacted (position order) into a smaller static buffer.

Question probe (ours, off by default; docs/results.md §2c): with question_tokens = N > 0 the first
eviction after the prompt probes the prompt's last N tokens at their real positions plus
lookahead_blocks - 1 mask blocks after the prompt, in place of the step-0 block and its
lookahead (the step-0 mass is still added); pin_question keeps that span. Bounded prefill
(below) always probes this way, after every prefill chunk.

Question-aware MaskAhead (ours, `maskahead-qa`, docs/results.md "Beyond the paper"): the question
probe at every eviction (QuestionLookahead: the lookahead's mass plus the question's own), the
question span optionally pinned at every eviction (pin_question, off), and bounded prefill with
the question probe.

Issue 40's other knobs (ours, off by default; docs/results.md §2c-2): `head_alloc="adakv"` /
`layer_importance` spread a row's budget over KV heads / layers (eviction.Allocation: AdaKV's head
budgets, MaskKV's calibrated layer budgets), `evict_pool` max-pools the eviction scores over
neighbouring slots.

The knobs are the released code's (SelectorConfig / EvictionConfig); `selector` and `eviction`
compose them into the parts the engine runs (policies/composed.py).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from ..kernels.reference import POOLS
from .composed import ComposedPolicy
from .eviction import Allocation, Budget, Eviction, ForcedKeeps, budget_of, check_budget
from .schedules import BoundedPrefill, Deferred
from .probes import FILLS, DapQ as DapQProbe, Lookahead, Question, QuestionLookahead
from .protocol import PolicyError
from .scorers import MassScore, Pooled, ProbeMass, ValueScore
from .selection import Selector

RANKINGS = ("value", "mass", "none")


def check_pct(**values) -> None:
    for name, v in values.items():
        if not 0 < v <= 100:
            raise PolicyError(f"{name} must be in (0, 100], got {v}")


def check_positive(**values) -> None:
    for name, v in values.items():
        if v <= 0:
            raise PolicyError(f"{name} must be positive, got {v}")


@dataclasses.dataclass(frozen=True)
class MaskAhead(ComposedPolicy):
    """MaskAhead with the released code's defaults (research/maskahead.md §6 "Budgets")."""

    name = "maskahead"
    capacity_pct: float = 10.0
    capacity_floor: int = 512
    topk_pct: float = 5.0
    topk_floor: int = 256
    dense_layers: int = 2
    sinks: int = 4
    recent: int = 64
    interval_blocks: int = 4
    lookahead_blocks: int = 4
    select_ranking: str = "value"  # value: a*||v-c|| | mass: a (MAGE-like) | none: read everything
    evict_ranking: str = "value"  # value | mass | none (no eviction)
    question_tokens: int = 0  # > 0: the first eviction probes the question's last N tokens
    pin_question: bool = False  # with question_tokens: that span always survives
    capacity_entries: int = 0  # > 0: an absolute budget of KV entries per lane (pct / floor unused)
    evict_pool: int = 1  # > 1: eviction scores max-pooled over this many neighbouring slots (ours)
    # ours (issue 40): MaskKV's adaptive budgets in the eviction (eviction.Allocation); the row
    # budget is the same, its split over layers / heads is not
    layer_importance: tuple = ()  # one importance per layer (maskahead calibrate): Eq. 9-13 layer split
    alloc_beta: float = 0.4  # MaskKV's beta: the share every layer keeps before the importance split
    head_alloc: str = "uniform"  # uniform | adakv (heads with the layer's top scores keep more)
    alloc_floor: float = 0.2  # adakv: each head keeps at least this share of its layer's C_l
    alloc_lane_cap: float = 2.0  # no lane keeps more than this x C

    # ------------------------------------------------------------------ parts
    @property
    def selector(self) -> Optional[Selector]:
        if self.select_ranking == "none":
            return None
        return Selector(self.select_ranking, self.topk_pct, self.topk_floor, self.dense_layers)

    def budget(self) -> Budget:
        return budget_of(self)

    @property
    def eviction(self) -> Optional[Eviction]:
        if self.evict_ranking == "none":
            return None
        m = self.lookahead_blocks
        first = Question(self.question_tokens, m) if self.question_tokens else None
        scorer = ValueScore() if self.evict_ranking == "value" else MassScore()
        if self.evict_pool > 1:
            scorer = Pooled(scorer, self.evict_pool)
        budget = self.budget()
        alloc = Allocation(tuple(float(x) for x in self.layer_importance), self.alloc_beta, self.head_alloc,
                           self.alloc_floor, self.alloc_lane_cap, budget.multiple)
        schedule = Deferred(self.interval_blocks, probe=Lookahead(m) if m > 1 else None, first_probe=first,
                            pin_first=self.pin_question)
        return Eviction(budget, scorer, ForcedKeeps(self.sinks, self.recent), schedule, allocation=alloc)

    @property
    def takes_budget(self) -> bool:  # the variants that never evict have no budget to sweep
        return self.evict_ranking != "none"

    # ------------------------------------------------------------------ checks
    def validate(self, cfg, gen) -> None:
        if self.select_ranking not in RANKINGS:
            raise PolicyError(f"select_ranking must be value|mass|none, got {self.select_ranking!r}")
        if self.evict_ranking not in RANKINGS:
            raise PolicyError(f"evict_ranking must be value|mass|none, got {self.evict_ranking!r}")
        check_pct(topk_pct=self.topk_pct)
        check_positive(topk_floor=self.topk_floor, interval_blocks=self.interval_blocks,
                       lookahead_blocks=self.lookahead_blocks, evict_pool=self.evict_pool)
        if self.sinks < 0 or self.recent < 0 or self.dense_layers < 0:
            raise PolicyError("sinks, recent and dense_layers must be >= 0")
        if self.question_tokens < 0:
            raise PolicyError(f"question_tokens must be >= 0, got {self.question_tokens}")
        if self.layer_importance and cfg is not None and len(self.layer_importance) != cfg.num_layers:
            raise PolicyError(f"layer_importance has {len(self.layer_importance)} values, the model "
                              f"has {cfg.num_layers} layers")
        self.check_question()
        check_budget(self, self.recent + self.sinks if self.evict_ranking != "none" else 0)

    def check_question(self) -> None:
        ev = self.eviction
        if self.question_tokens and (ev is None or ev.schedule.probe is None):
            raise PolicyError(
                f"question_tokens={self.question_tokens} needs MaskAhead's lookahead probe "
                f"(evict_ranking != 'none', lookahead_blocks > 1); {self.label} has none")
        if self.pin_question and not self.question_tokens:
            raise PolicyError("pin_question needs question_tokens > 0 (the span to pin)")


@dataclasses.dataclass(frozen=True)
class BoundedPrefillMaskAhead(MaskAhead):
    """MaskAhead that also evicts during chunked prefill (the released `ours_prefill_qprobe`):
    after each stored chunk, a probe of the question (the prompt's last `question_tokens` tokens
    at their real positions) plus lookahead_blocks - 1 mask blocks scores the cache, and rows
    over C(seen) are compacted; the question span can be pinned. Peak KV memory stays near the
    capacity plus one prefill chunk instead of the whole prompt."""

    name = "maskahead-bounded"
    question_tokens: int = 64
    pin_question: bool = True

    @property
    def eviction(self) -> Optional[Eviction]:
        ev = super().eviction
        if ev is None:
            return None
        q = Question(self.question_tokens, self.lookahead_blocks)
        return dataclasses.replace(ev, schedule=dataclasses.replace(ev.schedule, first_probe=None, pin_first=False),
                                   prefill=BoundedPrefill(q, pin=self.pin_question))

    def check_question(self) -> None:
        if self.question_tokens <= 0:
            raise PolicyError(f"question_tokens must be positive, got {self.question_tokens}")


@dataclasses.dataclass(frozen=True)
class QuestionAwareMaskAhead(MaskAhead):
    """MaskAhead whose every eviction keeps what the question asks for (ours).

    question_every   True: every block eviction ranks by step-0 mass + lookahead mass +
                     question_weight x the question's mass (probes.QuestionLookahead), and
                     pin_question pins the question span at every one of them; False: only the
                     first eviction probes (and pins) the question (MaskAhead(question_tokens=N))
    bounded_prefill  also evict after every prefill chunk, scored by the question probe
                     (BoundedPrefillMaskAhead's), so the peak stays near C + one chunk
    question_weight  the question mass's weight (0: lookahead_blocks, Question's scaling)
    question_pool    how the question probes pool their rows (reference.POOLS): "mean" (the
                     released rule), "max", "mean+max", "max_joint" (each computed in the
                     attention kernels' statistics pass too)
    draft_tokens     n > 0: generate first runs this policy without a draft for n new tokens (at
                     most max_new_tokens), and bounded prefill's question probe reads that answer
                     in its mask blocks (`draft_pass`; block-causal models)

    What they measure: docs/results.md §2. The knobs that measured no better than these
    defaults (prefill_slack, defer_final_chunk, hide_question, question_masks, step0_weight,
    first_block_probe, prefill_budget, draft_capacity_pct, draft_probe, draft_past_answer) live
    in the experiments plugin experiments/qa_lab.py (`maskahead-qa-lab` and friends), with
    their measurements in docs/notes/2026-12-05-issue40-question-aware.md.
    """

    name = "maskahead-qa"
    question_tokens: int = 128
    pin_question: bool = False  # pinned: 85.7 against 90.3 on the testbed suite (results.md)
    question_every: bool = True
    bounded_prefill: bool = True
    question_weight: float = 0.0
    question_pool: str = "mean"
    draft_tokens: int = 0

    def draft_pass(self, max_new_tokens: Optional[int] = None):
        """draft_tokens > 0: generate first runs this policy without a draft for draft_tokens new
        tokens (at most max_new_tokens, the run's answer limit); bounded prefill's question probe
        then reads that answer in its mask blocks."""
        if self.draft_tokens <= 0:
            return None
        n = self.draft_tokens if max_new_tokens is None else min(self.draft_tokens, int(max_new_tokens))
        return n, dataclasses.replace(self, draft_tokens=0)

    # ------------------------------------------------------------------ parts (a subclass may refine)
    def question_probe(self) -> Question:
        """Bounded prefill's probe: the question at its real positions and the mask blocks after it
        (opening with the draft, when there is one)."""
        return Question(self.question_tokens, self.lookahead_blocks, pool=self.question_pool,
                        draft=self.draft_tokens > 0)

    def block_probe(self) -> QuestionLookahead:
        """Every block eviction's probe: the lookahead's mass plus the question's own."""
        w = self.question_weight or float(self.lookahead_blocks)
        return QuestionLookahead(self.question_tokens, self.lookahead_blocks, w, pool=self.question_pool)

    def bounded(self, probe) -> BoundedPrefill:
        return BoundedPrefill(probe, self.pin_question)

    @property
    def eviction(self) -> Optional[Eviction]:
        ev = super().eviction  # question_every=False: the first-eviction question probe
        if ev is None or self.question_tokens <= 0:
            return ev
        sched = ev.schedule
        if self.question_every:
            sched = dataclasses.replace(sched, probe=self.block_probe(), first_probe=None, pin_first=False,
                                        pin_probe=self.pin_question)
        prefill = self.bounded(self.question_probe()) if self.bounded_prefill else None
        return dataclasses.replace(ev, schedule=sched, prefill=prefill)

    def check_question(self) -> None:
        if self.question_tokens <= 0:
            raise PolicyError(f"question_tokens must be positive, got {self.question_tokens}")
        if self.lookahead_blocks < 2:
            raise PolicyError(f"{self.label} needs the lookahead probe: lookahead_blocks >= 2, "
                              f"got {self.lookahead_blocks}")
        if self.question_weight < 0:
            raise PolicyError(f"question_weight must be >= 0, got {self.question_weight}")
        if self.draft_tokens < 0:
            raise PolicyError(f"draft_tokens must be >= 0, got {self.draft_tokens}")
        if self.draft_tokens and not self.drafts_are_read():
            raise PolicyError("draft_tokens needs bounded_prefill=True: only its question probe reads the draft")
        if self.question_pool not in POOLS:
            raise PolicyError(f"question_pool must be one of {'|'.join(POOLS)}, got {self.question_pool!r}")

    def drafts_are_read(self) -> bool:
        return self.bounded_prefill


@dataclasses.dataclass(frozen=True)
class DapQ(MaskAhead):
    """The released `dapq` baseline (configs/dapq.yaml): MaskAhead's deferred lookahead schedule
    with another probe (released EvictionConfig.lookahead_probe):

      "dapq"      (default) DapQ itself: 32 pseudo tokens, the first 4 and the last
                  block_size - 4 tokens of the committed context, at the current block's
                  positions; the eviction ranks by their attention mass alone (no step-0 term,
                  no value term: released session.end_dapq_probe -> _evict_by_probe(use_value=False))
      "random" / "dapq_fill" / "mask"  MaskAhead's lookahead with its probe blocks filled with
                  uniform random tokens / the DapQ pattern / masks, ranked as MaskAhead ranks
                  (step-0 mass + probe mass, x ||v - c|| unless evict_ranking="mass")
    """

    name = "dapq"
    lookahead_probe: str = "dapq"

    @property
    def eviction(self) -> Optional[Eviction]:
        ev = super().eviction
        if ev is None:
            return None
        if self.lookahead_probe == "dapq":
            return dataclasses.replace(ev, scorer=ProbeMass(), schedule=dataclasses.replace(ev.schedule, probe=DapQProbe()))
        fill = {"dapq_fill": "dapq"}.get(self.lookahead_probe, self.lookahead_probe)
        return dataclasses.replace(ev, schedule=dataclasses.replace(ev.schedule, probe=Lookahead(self.lookahead_blocks, fill)))

    def validate(self, cfg, gen) -> None:
        kinds = ("dapq", "dapq_fill") + tuple(f for f in FILLS if f != "dapq")
        if self.lookahead_probe not in kinds:
            raise PolicyError(f"lookahead_probe must be one of {'|'.join(kinds)}, got {self.lookahead_probe!r}")
        if self.evict_ranking == "none":
            raise PolicyError("dapq is an eviction policy: evict_ranking must be value or mass")
        if self.lookahead_probe != "dapq" and self.lookahead_blocks < 2:
            raise PolicyError(f"lookahead_probe={self.lookahead_probe!r} needs lookahead_blocks >= 2")
        super().validate(cfg, gen)
