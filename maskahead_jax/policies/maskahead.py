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
    prefill_slack    bounded prefill keeps prefill_slack x C(seen) entries (1: C(seen)), so
                     facts the question does not name (a second hop) survive until the first
                     block's lookahead can ask for them; the peak grows by (slack - 1) x C
    defer_final_chunk  bounded prefill does not compact after the prompt's final chunk: the
                     first block's eviction ranks that chunk and the C(seen) kept before it
                     with the lookahead probe (facts near the question survive until the
                     answer's masks can ask for them); the peak stays C + one chunk
    hide_question    which question probes read the cache without the question's own entries
                     (probes.Question.hide_cached; they still read their re-run copy): "none",
                     "blocks" (the block evictions' QuestionLookahead), "all" (and bounded
                     prefill's Question probe), so the question's mass goes to what it asks for
    question_masks   True: the block evictions' question forward carries the mask blocks after
                     the question, as bounded prefill's probe does (what an answer to the
                     question reads, not only what the question's own tokens read)
    step0_weight     the weight of the current block's step-0 mass in block evictions (1: the
                     released ranking; 0: the probes alone, as bounded prefill ranks)
    first_block_probe  "lookahead": the first block's eviction probes as every block's does;
                     "question": with bounded prefill's probe (the question and its mask blocks),
                     so with step0_weight=0 it ranks as bounded prefill ranks, once
    The last five were measured on the testbed (docs/results.md §2c-3): none beats the defaults.
    question_pool    how the question probes pool their rows (reference.POOLS): "mean" (the
                     released rule), "max", "mean+max", "max_joint" (each computed in the
                     attention kernels' statistics pass too)
    draft_tokens     n > 0: generate first runs this policy without a draft for n new tokens (at
                     most max_new_tokens), and bounded prefill's question probe reads that answer
                     in its mask blocks (`draft_pass`; block-causal models)
    draft_probe      how bounded prefill's probe reads the draft (probes.Question.draft_probe):
                     "tokens" (as drafted) or "interleaved" (two forwards, its even / odd
                     positions masked again, so mask queries ask for each drafted position)
    draft_past_answer  False: the draft is at most the run's max_new_tokens (the answer's own
                     length limit); True: draft_tokens whatever that limit, so a short answer's
                     draft goes on into the model's continuation (it asks itself about other
                     documents or cases, and those queries probe the prompt too)
    draft_capacity_pct  > 0: the first pass keeps this budget instead of capacity_pct (a draft
                     read from more of the prompt; the run's peak is the larger pass's, the end
                     memory the second's); 0: the run's own budget
    prefill_budget   "seen": bounded prefill keeps C(seen so far); "prompt": C(whole stored
                     prompt) from the first chunk on (the peak grows to C(prompt) + one chunk)
    Measured in docs/results.md §2c-4: the draft with mean+max rows is the best row
    (`q-maskahead-draft`); §2c-5 / §2c-6: draft_capacity_pct, draft_probe="interleaved" and
    draft_past_answer do not beat it (knobs, off by default).
    """

    name = "maskahead-qa"
    question_tokens: int = 128
    pin_question: bool = False  # pinned: 85.7 against 90.3 on the testbed suite (results.md)
    question_every: bool = True
    bounded_prefill: bool = True
    question_weight: float = 0.0
    prefill_slack: float = 1.0
    defer_final_chunk: bool = False
    hide_question: str = "none"
    question_masks: bool = False
    step0_weight: float = 1.0
    first_block_probe: str = "lookahead"
    question_pool: str = "mean"
    draft_tokens: int = 0
    draft_capacity_pct: float = 0.0
    draft_probe: str = "tokens"
    prefill_budget: str = "seen"
    draft_past_answer: bool = False

    def draft_pass(self, max_new_tokens: Optional[int] = None):
        """draft_tokens > 0: generate first runs this policy without a draft for draft_tokens new
        tokens (at most max_new_tokens, the run's answer limit, unless draft_past_answer); bounded
        prefill's question probe then reads that answer in its mask blocks."""
        if self.draft_tokens <= 0:
            return None
        n = self.draft_tokens
        if max_new_tokens is not None and not self.draft_past_answer:
            n = min(n, int(max_new_tokens))
        return n, dataclasses.replace(
            self, draft_tokens=0, draft_capacity_pct=0.0, draft_past_answer=False,
            capacity_pct=float(self.draft_capacity_pct) if self.draft_capacity_pct else self.capacity_pct)

    @property
    def eviction(self) -> Optional[Eviction]:
        ev = super().eviction  # question_every=False: the first-eviction question probe
        if ev is None or self.question_tokens <= 0:
            return ev
        m = self.lookahead_blocks
        question = Question(self.question_tokens, m, self.hide_question == "all",  # bounded prefill's probe
                            self.question_pool, draft=self.draft_tokens > 0, draft_probe=self.draft_probe)
        sched = dataclasses.replace(ev.schedule, step0_weight=self.step0_weight)
        if self.question_every:
            w = self.question_weight or float(m)
            probe = QuestionLookahead(self.question_tokens, m, w, hide_cached=self.hide_question != "none",
                                      with_masks=self.question_masks, pool=self.question_pool)
            sched = dataclasses.replace(sched, probe=probe, first_probe=None, pin_first=False,
                                        pin_probe=self.pin_question)
        if self.first_block_probe == "question":
            sched = dataclasses.replace(sched, first_probe=question)
        prefill = None
        if self.bounded_prefill:
            prefill = BoundedPrefill(question, self.pin_question, self.prefill_slack, self.defer_final_chunk,
                                     self.prefill_budget)
        return dataclasses.replace(ev, schedule=sched, prefill=prefill)

    def check_question(self) -> None:
        if self.question_tokens <= 0:
            raise PolicyError(f"question_tokens must be positive, got {self.question_tokens}")
        if self.lookahead_blocks < 2:
            raise PolicyError(f"{self.label} needs the lookahead probe: lookahead_blocks >= 2, "
                              f"got {self.lookahead_blocks}")
        if self.question_weight < 0:
            raise PolicyError(f"question_weight must be >= 0, got {self.question_weight}")
        if not self.prefill_slack >= 1.0:
            raise PolicyError(f"prefill_slack must be >= 1, got {self.prefill_slack}")
        if not self.step0_weight >= 0:
            raise PolicyError(f"step0_weight must be >= 0, got {self.step0_weight}")
        if self.first_block_probe not in ("lookahead", "question"):
            raise PolicyError(f"first_block_probe must be lookahead|question, got {self.first_block_probe!r}")
        if self.draft_tokens < 0:
            raise PolicyError(f"draft_tokens must be >= 0, got {self.draft_tokens}")
        if self.draft_tokens and not (self.bounded_prefill or self.first_block_probe == "question"):
            raise PolicyError("draft_tokens needs bounded_prefill=True or first_block_probe=question: "
                              "only their question probe reads the draft")
        if self.draft_past_answer and not self.draft_tokens:
            raise PolicyError("draft_past_answer=True needs draft_tokens > 0: it sets how far the draft runs")
        if self.draft_probe not in ("tokens", "interleaved"):
            raise PolicyError(f"draft_probe must be tokens|interleaved, got {self.draft_probe!r}")
        if self.draft_capacity_pct:
            if not self.draft_tokens:
                raise PolicyError(f"draft_capacity_pct={self.draft_capacity_pct:g} needs draft_tokens > 0: "
                                  "it is the first (drafting) pass's budget")
            if not 0 < self.draft_capacity_pct <= 100:
                raise PolicyError(f"draft_capacity_pct must be in (0, 100], got {self.draft_capacity_pct}")
            if self.capacity_entries:
                raise PolicyError("draft_capacity_pct is a percentage of the prompt; with an absolute "
                                  f"budget (capacity_entries={self.capacity_entries}) leave it 0")
        if self.question_pool not in POOLS:
            raise PolicyError(f"question_pool must be one of {'|'.join(POOLS)}, got {self.question_pool!r}")
        if self.hide_question not in ("none", "blocks", "all"):
            raise PolicyError(f"hide_question must be one of none|blocks|all, got {self.hide_question!r}")


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
