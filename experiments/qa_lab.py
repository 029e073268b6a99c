"""The question-aware policy's lab knobs: measured on the testbed, none beat the defaults, so they
live here, outside the product, as a policy plugin (issue 54).

    PYTHONPATH=. MASKAHEAD_POLICY_PLUGINS=experiments.qa_lab \\
        maskahead eval ... --policies q-maskahead-qa-lab --policy-kw prefill_slack=2

registers `maskahead-qa-lab`, `q-maskahead-qa-lab` and `q-maskahead-draft-lab`: the product's
`maskahead-qa`, `q-maskahead-qa` and `q-maskahead-draft` (same defaults: with no knob given they
run the same tokens) with these knobs. Their measurements:
docs/notes/2026-12-05-issue40-question-aware.md (§2c-2 to §2c-6 there).

  prefill_slack      bounded prefill keeps prefill_slack x C(seen) entries (1: C(seen)), so facts
                     the question does not name (a second hop) survive until the first block's
                     lookahead can ask for them; the peak grows by (slack - 1) x C
  defer_final_chunk  bounded prefill does not compact after the prompt's final chunk: the first
                     block's eviction ranks that chunk with the lookahead probe
  prefill_budget     "seen": bounded prefill keeps C(seen so far); "prompt": C(whole stored
                     prompt) from the first chunk on
  hide_question      which question probes read the cache without the question's own entries:
                     "none", "blocks" (the block evictions'), "all" (and bounded prefill's)
  question_masks     the block evictions' question forward carries the mask blocks after the
                     question, as bounded prefill's probe does
  step0_weight       the weight of the current block's step-0 mass in block evictions (1: the
                     released ranking; 0: the probes alone)
  first_block_probe  "lookahead" (every block's), or "question": bounded prefill's probe
  draft_probe        how bounded prefill's probe reads the draft: "tokens" (as drafted) or
                     "interleaved" (two forwards, its even / odd positions masked again)
  draft_past_answer  True: draft draft_tokens whatever the run's max_new_tokens
  draft_capacity_pct > 0: the drafting pass keeps this budget instead of capacity_pct

The mechanisms behind them are refinements of the core's strategy and probe objects, here
too: LabDeferred (step0_mass), LabBoundedPrefill (capacity / bound), LabQuestion (view /
answers), LabQuestionLookahead (question_mass). `python experiments/golden_policies.py compare
runs/golden_lab.json --lab` checks that they run the tokens they ran inside the core.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import math

import jax
import jax.numpy as jnp

from maskahead_jax.policies import DraftedMaskAhead, Packed, QuestionAwareMaskAhead, register
from maskahead_jax.policies.budgets import guarded
from maskahead_jax.policies.errors import PolicyError
from maskahead_jax.policies.probes import Question, QuestionLookahead
from maskahead_jax.policies.schedules import BoundedPrefill, Deferred

PREFILL_BUDGETS = ("seen", "prompt")


def extend(cls, part, **knobs):
    """The core part `part` as its lab subclass `cls`, with the lab's knobs."""
    return cls(**{f.name: getattr(part, f.name) for f in dataclasses.fields(part)}, **knobs)


@dataclasses.dataclass(frozen=True)
class LabDeferred(Deferred):
    """Deferred whose block evictions rank by step0_weight x step-0 mass + probe mass."""

    step0_weight: float = 1.0

    def step0_mass(self, ctx):
        m = ctx.mass
        return m if self.step0_weight == 1.0 or m is None else self.step0_weight * m


@dataclasses.dataclass(frozen=True)
class LabBoundedPrefill(BoundedPrefill):
    """Bounded prefill keeping slack x C(seen) (budget="seen") or slack x C(whole stored prompt)
    from the first chunk on (budget="prompt"); defer_final_chunk leaves the prompt's final chunk
    to the first block's eviction."""

    slack: float = 1.0
    defer_final_chunk: bool = False
    budget: str = "seen"

    def __post_init__(self):
        if not self.slack >= 1.0:
            raise PolicyError(f"prefill_slack must be >= 1 (a multiple of C(seen)), got {self.slack}")
        if self.budget not in PREFILL_BUDGETS:
            raise PolicyError(f"prefill_budget must be seen|prompt, got {self.budget!r}")

    def capacity(self, budget, seen):
        c = budget.capacity(seen)
        if self.slack == 1.0:
            return c
        if isinstance(seen, int):
            return int(math.floor(guarded(self.slack * c)))
        return jnp.floor(guarded(self.slack * c.astype(jnp.float32))).astype(jnp.int32)

    def bound(self, ev, cache, ctx):
        seen = cache.seen if self.budget == "seen" else jnp.maximum(cache.seen, ctx.n_pre)
        cap = self.capacity(ev.budget, seen)
        over = cache.length > cap
        if self.defer_final_chunk:  # the first block's eviction (lookahead + question) ranks it
            over = over & (ctx.start + ctx.appended < ctx.n_pre)
        return cap, over


def hide_question(probe, cache, ctx):
    """The cache without the question's own entries when `probe.hide_cached`: the probe re-runs
    the question's tokens and attends to them in its own forward, and once the prompt's last
    chunk is stored the cache holds the same keys again, so each question query would read its
    own span twice. Hidden entries get no mass from this probe."""
    if not probe.hide_cached:
        return cache
    return cache._replace(valid=cache.valid & ~Question(probe.tokens, probe.blocks).span(cache, ctx))


@dataclasses.dataclass(frozen=True)
class LabQuestion(Question):
    """Question, optionally over the cache without its own span (hide_cached), and reading a draft
    "interleaved": two forwards, the draft's even then its odd positions masked again, their
    masses averaged."""

    hide_cached: bool = False
    draft_probe: str = "tokens"  # tokens | interleaved

    def view(self, cache, ctx):
        return hide_question(self, cache, ctx)

    def answers(self, answer: jax.Array, mask_id: int) -> list:
        if self.draft_probe != "interleaved":
            return [answer]
        parity = jnp.arange(answer.shape[1])[None] % 2
        return [jnp.where(parity == p, mask_id, answer) for p in (0, 1)]


@dataclasses.dataclass(frozen=True)
class LabQuestionLookahead(QuestionLookahead):
    """QuestionLookahead whose question forward hides the question's cached copy (hide_cached) or
    carries the mask blocks after it (with_masks: Question's forward, / blocks)."""

    hide_cached: bool = False
    with_masks: bool = False

    def question_mass(self, cache, ctx):
        if self.with_masks:
            probe = LabQuestion(self.tokens, self.blocks, self.pool, hide_cached=self.hide_cached)
            return probe.mass(cache, ctx) / self.blocks
        return super().question_mass(hide_question(self, cache, ctx), ctx)


@dataclasses.dataclass(frozen=True)
class LabQuestionAware(QuestionAwareMaskAhead):
    name = "maskahead-qa-lab"
    prefill_slack: float = 1.0
    defer_final_chunk: bool = False
    prefill_budget: str = "seen"
    hide_question: str = "none"
    question_masks: bool = False
    step0_weight: float = 1.0
    first_block_probe: str = "lookahead"
    draft_probe: str = "tokens"
    draft_past_answer: bool = False
    draft_capacity_pct: float = 0.0

    def question_probe(self):
        return extend(LabQuestion, super().question_probe(), hide_cached=self.hide_question == "all",
                      draft_probe=self.draft_probe)

    def block_probe(self):
        return extend(LabQuestionLookahead, super().block_probe(), hide_cached=self.hide_question != "none",
                      with_masks=self.question_masks)

    def bounded(self, probe):
        return extend(LabBoundedPrefill, super().bounded(probe), slack=self.prefill_slack,
                      defer_final_chunk=self.defer_final_chunk, budget=self.prefill_budget)

    @property
    def eviction(self):
        ev = super().eviction
        if ev is None or self.question_tokens <= 0:
            return ev
        sched = extend(LabDeferred, ev.schedule, step0_weight=self.step0_weight)
        if self.first_block_probe == "question":
            sched = dataclasses.replace(sched, first_probe=self.question_probe())
        return dataclasses.replace(ev, schedule=sched)

    def draft_pass(self, max_new_tokens: Optional[int] = None):
        if self.draft_tokens <= 0:
            return None
        n, _ = super().draft_pass(None if self.draft_past_answer else max_new_tokens)
        first = dataclasses.replace(
            self, draft_tokens=0, draft_capacity_pct=0.0, draft_past_answer=False,
            capacity_pct=float(self.draft_capacity_pct) if self.draft_capacity_pct else self.capacity_pct)
        return n, first

    def drafts_are_read(self) -> bool:
        return self.bounded_prefill or self.first_block_probe == "question"

    def check_question(self) -> None:
        super().check_question()
        if not self.prefill_slack >= 1.0:
            raise PolicyError(f"prefill_slack must be >= 1, got {self.prefill_slack}")
        if not self.step0_weight >= 0:
            raise PolicyError(f"step0_weight must be >= 0, got {self.step0_weight}")
        if self.first_block_probe not in ("lookahead", "question"):
            raise PolicyError(f"first_block_probe must be lookahead|question, got {self.first_block_probe!r}")
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
        if self.hide_question not in ("none", "blocks", "all"):
            raise PolicyError(f"hide_question must be one of none|blocks|all, got {self.hide_question!r}")


@dataclasses.dataclass(frozen=True)
class LabDrafted(LabQuestionAware):
    """q-maskahead-draft's defaults (DraftedMaskAhead) with the lab knobs."""

    name = "maskahead-draft-lab"
    draft_tokens: int = DraftedMaskAhead.draft_tokens
    question_pool: str = DraftedMaskAhead.question_pool


PACKED4 = Packed(4)
register("maskahead-qa-lab", LabQuestionAware)
register("q-maskahead-qa-lab", LabQuestionAware, defaults=dict(storage=PACKED4, head_alloc="adakv"))
register("q-maskahead-draft-lab", LabDrafted, defaults=dict(storage=PACKED4, head_alloc="adakv"))
