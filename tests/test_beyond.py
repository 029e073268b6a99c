"""Question-aware MaskAhead (`maskahead-qa`, docs/results.md "Beyond the paper"): the question
probe at every eviction, checked against a direct computation of what it forwards and how it
ranks; through generate: exact at full budget, every block eviction pins the question and keeps
the top entries by a numpy ranking, memory bounded; bad settings are clear errors."""
from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.qa_lab import LabQuestionAware as Lab  # the lab knobs' plugin (registers its names)
from experiments.qa_lab import LabDeferred, LabQuestion, LabQuestionLookahead
from maskahead_jax.config import GenerationConfig
from maskahead_jax.generate import BudgetWarning, generate
from maskahead_jax.policies import MaskAhead, PolicyError, QuestionAwareMaskAhead, StepContext, make
from maskahead_jax.policies.eviction import Eviction
from maskahead_jax.policies.probes import Lookahead, Question, QuestionLookahead
from tiny import tiny_model

FULL = dict(capacity_pct=100, capacity_floor=4096, topk_pct=100, topk_floor=4096, dense_layers=1)
SMALL = dict(capacity_pct=10, capacity_floor=24, topk_pct=5, topk_floor=16, dense_layers=1, sinks=2,
             recent=8, interval_blocks=2, lookahead_blocks=3)


def _prompts(lens=(150, 97), seed=3):
    rng = np.random.RandomState(seed)
    return [list(map(int, rng.randint(0, 40, size=n))) for n in lens]


def test_question_lookahead_probe_is_lookahead_plus_weighted_question_mass():
    """The probe's forwards, by hand: the lookahead's [block | masks] and the question's own
    tokens at their real positions, mutually visible; mass = lookahead + weight * question."""
    calls = []
    L, B, H, N = 2, 2, 1, 12

    def forward(cache, toks, pos, mask, rows):
        rows = getattr(rows, "rows", rows)  # a StatsRequest or rows
        calls.append(tuple(np.asarray(a) for a in (toks, pos, mask, rows)))
        # a deterministic mass that depends on what was forwarded
        base = np.asarray(toks).sum(1) + 3 * np.asarray(pos).sum(1) + np.asarray(rows).sum(1)
        return jnp.asarray(np.broadcast_to((base[None, :, None, None] + np.arange(N)) % 17, (L, B, H, N)),
                           jnp.float32)

    prompt = jnp.asarray(np.arange(40).reshape(2, 20) + 100, jnp.int32)
    plen = jnp.asarray([20, 13], jnp.int32)
    ctx = StepContext(forward=forward, prompt=prompt, plen=plen, n_pre=jnp.asarray([16, 8]), block_size=4,
                      mask_id=3, capacity=N, active=jnp.asarray([True, True]),
                      tokens=jnp.full((2, 4), 3, jnp.int32), start=jnp.asarray([24, 16], jnp.int32))
    probe = QuestionLookahead(tokens=5, blocks=3, weight=2.5)
    got = np.asarray(probe.mass(None, ctx))
    assert len(calls) == 2
    calls_la = calls[0]
    la = np.asarray(Lookahead(3).mass(None, ctx))  # the same lookahead forward, again
    assert all(np.array_equal(a, b) for a, b in zip(calls[2], calls_la))
    toks, pos, mask, rows = calls[1]
    for b, p in enumerate((20, 13)):  # the prompt's last 5 tokens at their own positions
        assert pos[b].tolist() == list(range(p - 5, p))
        assert toks[b].tolist() == [100 + 20 * b + i for i in range(p - 5, p)]
    assert mask.all() and rows.all() and mask.shape == (2, 5, 5)
    base = toks.sum(1) + 3 * pos.sum(1) + rows.sum(1)
    q = (base[None, :, None, None] + np.arange(N)) % 17
    np.testing.assert_allclose(got, la + 2.5 * q, rtol=1e-6)
    assert probe.forwards == 2


def test_question_masks_probe_forwards_the_question_with_its_mask_blocks():
    """with_masks: the question forward of QuestionLookahead is Question's (the question, then
    blocks - 1 mask blocks after it), divided by blocks; mass = lookahead + weight * that."""
    L, B, H, N = 2, 2, 1, 12
    calls = []

    def forward(cache, toks, pos, mask, rows):
        calls.append((np.asarray(toks), np.asarray(pos)))
        base = np.asarray(toks).sum(1) + 3 * np.asarray(pos).sum(1)
        return jnp.asarray(np.broadcast_to((base[None, :, None, None] + np.arange(N)) % 17, (L, B, H, N)),
                           jnp.float32)

    prompt = jnp.asarray(np.arange(40).reshape(2, 20) + 100, jnp.int32)
    ctx = StepContext(forward=forward, prompt=prompt, plen=jnp.asarray([20, 13], jnp.int32),
                      n_pre=jnp.asarray([16, 8]), block_size=4, mask_id=3, capacity=N,
                      active=jnp.asarray([True, True]), tokens=jnp.full((2, 4), 3, jnp.int32),
                      start=jnp.asarray([24, 16], jnp.int32))
    got = np.asarray(LabQuestionLookahead(5, 3, 2.5, with_masks=True).mass(None, ctx))
    toks, pos = calls[1]
    assert toks.shape == (2, 5 + 2 * 4) and (toks[:, 5:] == 3).all()  # question + 2 mask blocks
    assert pos[0].tolist() == list(range(15, 20 + 8)) and pos[1].tolist() == list(range(8, 13 + 8))
    la = np.asarray(Lookahead(3).mass(None, ctx))
    q = np.asarray(Question(5, 3).mass(None, ctx)) / 3
    np.testing.assert_allclose(got, la + 2.5 * q, rtol=1e-6)
    assert Lab(**SMALL, question_masks=True).eviction.schedule.probe.with_masks


def test_hidden_question_probe_reads_no_cached_copy_of_the_question():
    """hide_cached: the question's queries (Question, QuestionLookahead's question forward) read
    the cache without the question's own entries [plen - tokens, plen); the lookahead's mask
    blocks still read every entry; `hide_question` reaches the block probe ("blocks") or both
    ("all")."""
    from typing import NamedTuple

    class Book(NamedTuple):
        pos: jax.Array
        valid: jax.Array

    seen = []

    def forward(cache, toks, pos, mask, rows):
        seen.append(np.asarray(cache.valid))
        return jnp.zeros(cache.valid.shape, jnp.float32)

    L, N = 2, 24
    pos = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (L, 2, 1, N))
    cache = Book(pos, jnp.broadcast_to(jnp.arange(N) < 22, (L, 2, 1, N)))
    plen = jnp.asarray([20, 13], jnp.int32)
    ctx = StepContext(forward=forward, prompt=jnp.zeros((2, 20), jnp.int32), plen=plen,
                      n_pre=jnp.asarray([16, 8]), block_size=4, mask_id=3, capacity=N,
                      active=jnp.asarray([True, True]), tokens=jnp.full((2, 4), 3, jnp.int32),
                      start=jnp.asarray([24, 16], jnp.int32))
    question = (np.arange(N)[None] >= np.asarray(plen)[:, None] - 5) & (np.arange(N)[None] < np.asarray(plen)[:, None])
    want = np.asarray(cache.valid) & ~question[None, :, None, :]
    LabQuestion(5, 3, hide_cached=True).mass(cache, ctx)
    LabQuestionLookahead(5, 3, 2.0, hide_cached=True).mass(cache, ctx)
    Question(5, 3).mass(cache, ctx)
    assert np.array_equal(seen[0], want)  # Question: question + mask blocks, question hidden
    assert np.array_equal(seen[1], np.asarray(cache.valid))  # the lookahead's blocks read all
    assert np.array_equal(seen[2], want)  # QuestionLookahead's question forward
    assert np.array_equal(seen[3], np.asarray(cache.valid))  # default: the cache as it is
    ev = Lab(**SMALL, hide_question="all").eviction
    assert ev.schedule.probe.hide_cached and ev.prefill.probe.hide_cached
    ev = Lab(**SMALL, hide_question="blocks").eviction
    assert ev.schedule.probe.hide_cached and not ev.prefill.probe.hide_cached
    ev = QuestionAwareMaskAhead(**SMALL).eviction  # the product's probes have no such knob
    assert not hasattr(ev.schedule.probe, "hide_cached") and not hasattr(ev.prefill.probe, "hide_cached")


def test_question_pool_max_reaches_the_question_forwards_only():
    """question_pool="max": bounded prefill's Question probe and the block probe's question
    forward ask for max pooling in their StatsRequest (reference.prefix_mass's max over rows);
    the lookahead's forward keeps the mean (rows alone, or a request pooling by the mean)."""
    pools = []

    def forward(cache, toks, pos, mask, stats):
        pools.append(getattr(stats, "pool", "mean"))
        return jnp.zeros((1, 2, 1, 8), jnp.float32)

    ctx = StepContext(forward=forward, prompt=jnp.zeros((2, 20), jnp.int32), plen=jnp.asarray([20, 13]),
                      n_pre=jnp.asarray([16, 8]), block_size=4, mask_id=3, capacity=8,
                      active=jnp.asarray([True, True]), tokens=jnp.full((2, 4), 3, jnp.int32),
                      start=jnp.asarray([24, 16], jnp.int32))
    ev = QuestionAwareMaskAhead(**SMALL, question_pool="max").eviction
    assert ev.prefill.probe.pool == "max" and ev.schedule.probe.pool == "max"
    ev.prefill.probe.mass(None, ctx)
    ev.schedule.probe.mass(None, ctx)
    LabQuestionLookahead(**dataclasses.asdict(ev.schedule.probe), with_masks=True).mass(None, ctx)
    QuestionAwareMaskAhead(**SMALL).eviction.schedule.probe.mass(None, ctx)
    assert pools == ["max", "mean", "max", "mean", "max", "mean", "mean"]


def test_question_probe_reads_a_draft_in_its_answer_blocks():
    """draft: bounded prefill's question probe puts ctx.draft (a first pass's answer) at the
    answer's positions after the prompt, then masks to a whole number of blocks (at least
    blocks - 1); without ctx.draft, or without the flag, the answer blocks are all masks."""
    calls = []

    def forward(cache, toks, pos, mask, rows):
        rows = getattr(rows, "rows", rows)  # a StatsRequest or rows
        calls.append((np.asarray(toks), np.asarray(pos), np.asarray(rows)))
        return jnp.zeros((1, 2, 1, 8), jnp.float32)

    base = dict(forward=forward, prompt=jnp.asarray(np.arange(40).reshape(2, 20) + 100, jnp.int32),
                plen=jnp.asarray([20, 13], jnp.int32), n_pre=jnp.asarray([16, 8]), block_size=4, mask_id=3,
                capacity=8, active=jnp.asarray([True, True]))
    short = jnp.asarray([[50, 51, 52, 3, 3], [60, 61, 3, 3, 3]], jnp.int32)  # row 1 ended early
    Question(5, 3, draft=True).mass(None, StepContext(**base, draft=short))
    toks, pos, rows = calls[-1]
    assert toks.shape == (2, 5 + 8) and rows.all()
    assert toks[0, 5:].tolist() == [50, 51, 52, 3, 3, 3, 3, 3] and toks[1, 5:].tolist() == [60, 61] + [3] * 6
    assert pos[0, 5:].tolist() == list(range(20, 28)) and pos[1, 5:].tolist() == list(range(13, 21))
    long = jnp.asarray(np.arange(2 * 10).reshape(2, 10) + 200, jnp.int32)  # 10 > 2 blocks: 3 blocks
    Question(5, 3, draft=True).mass(None, StepContext(**base, draft=long))
    toks, pos, _ = calls[-1]
    assert toks.shape == (2, 5 + 12) and toks[0, 5:15].tolist() == list(range(200, 210))
    assert (toks[:, 15:] == 3).all() and pos[1, 5:].tolist() == list(range(13, 25))
    Question(5, 3, draft=True).mass(None, StepContext(**base))  # no draft: masks
    Question(5, 3).mass(None, StepContext(**base, draft=short))  # not asked: masks
    for toks, _, _ in calls[-2:]:
        assert toks.shape == (2, 13) and (toks[:, 5:] == 3).all()
    # interleaved: two forwards, the even then the odd drafted positions masked again; the mass
    # is their mean (each forward here returns its own constant)
    calls.clear()
    outs = iter([jnp.full((1, 2, 1, 8), 2.0), jnp.full((1, 2, 1, 8), 4.0)])
    ctx = StepContext(**dict(base, forward=lambda *a: (forward(*a), next(outs))[1]), draft=short)
    got = LabQuestion(5, 3, draft=True, draft_probe="interleaved").mass(None, ctx)
    assert len(calls) == 2 and np.allclose(np.asarray(got), 3.0 * 3)  # mean of 2 and 4, times blocks
    (even, pe, _), (odd, po, _) = calls
    assert even[0, 5:].tolist() == [3, 51, 3, 3, 3, 3, 3, 3] and odd[0, 5:].tolist() == [50, 3, 52, 3, 3, 3, 3, 3]
    assert even[:, :5].tolist() == odd[:, :5].tolist() and (pe == po).all()


def test_draft_pass_feeds_the_first_pass_answer_to_bounded_prefill():
    """draft_tokens=n: generate first runs the policy without a draft for min(n, max_new_tokens)
    new tokens, then the real run's hooks read those tokens (mask id after a row's end) as
    ctx.draft; the first pass's forwards are added to the run's, and its peak counts."""
    m = tiny_model("sdar", num_layers=2)
    prompts = _prompts((70, 45))
    gc = GenerationConfig(max_new_tokens=8, prefill_chunk=32, stop_at_eos=False)
    seen = []

    @dataclasses.dataclass(frozen=True)
    class Spy(QuestionAwareMaskAhead):
        def on_prefill_chunk(self, cache, ctx):
            if ctx.draft is not None:
                jax.debug.callback(lambda d: seen.append(np.asarray(d)), ctx.draft)
            return super().on_prefill_chunk(cache, ctx)

    pol = Spy(**SMALL, question_tokens=12, draft_tokens=16)
    n, first = pol.draft_pass()
    assert n == 16 and first == dataclasses.replace(pol, draft_tokens=0) and first.draft_pass() is None
    assert pol.eviction.prefill.probe.draft and not first.eviction.prefill.probe.draft
    out = generate(m, prompts, gc, policy=pol)
    want = generate(m, prompts, gc, policy=first)  # the first pass: capped at max_new_tokens = 8
    assert seen, "the second pass's prefill hooks saw no draft"
    for d in seen:  # every chunk of the second pass read the first pass's answer
        assert d.shape == (2, 8)
        for row, toks in zip(d, want.tokens):
            assert row[:len(toks)].tolist() == toks and (row[len(toks):] == m.config.mask_token_id).all()
    st = out.stats
    assert st["draft"]["nfe"] == want.stats["nfe"] and st["draft"]["tokens"] == [len(t) for t in want.tokens]
    assert all(a > b for a, b in zip(st["nfe"], want.stats["nfe"]))
    assert all(p >= q for p, q in zip(st["kv_bytes_peak"], want.stats["kv_bytes_peak"]))
    assert len(out.tokens[0]) == 8


def test_draft_capacity_is_the_first_pass_budget_and_its_peak_counts():
    """draft_capacity_pct: the first pass keeps that budget (its draft is that policy's answer);
    the second keeps its own, so the end memory is the second pass's, the peak the larger one."""
    m = tiny_model("sdar", num_layers=2)
    prompts = _prompts((300,))
    gc = GenerationConfig(max_new_tokens=8, prefill_chunk=32, stop_at_eos=False)
    pol = Lab(**SMALL, question_tokens=12, draft_tokens=8, draft_capacity_pct=60)
    n, first = pol.draft_pass()
    assert first == dataclasses.replace(pol, draft_tokens=0, draft_capacity_pct=0.0, capacity_pct=60.0)
    out = generate(m, prompts, gc, policy=pol)
    wide = generate(m, prompts, gc, policy=first)
    assert out.stats["draft"]["nfe"] == wide.stats["nfe"]
    assert out.stats["kv_bytes_peak"] == wide.stats["kv_bytes_peak"]  # the wide first pass's peak
    assert out.stats["kv_bytes_final"][0] < wide.stats["kv_bytes_final"][0] / 3  # C = 10%, not 60%


def test_draft_past_answer_drafts_draft_tokens_whatever_the_answer_limit():
    """The draft is at most the run's max_new_tokens, unless draft_past_answer: then it runs for
    draft_tokens (a short answer's draft goes on into the model's continuation); the first pass
    itself never drafts."""
    m = tiny_model("sdar", num_layers=2)
    pol = Lab(**SMALL, question_tokens=12, draft_tokens=12)
    past = dataclasses.replace(pol, draft_past_answer=True)
    assert pol.draft_pass(8)[0] == 8 and pol.draft_pass(20)[0] == 12 and pol.draft_pass()[0] == 12
    n, first = past.draft_pass(8)
    assert n == 12 and first == dataclasses.replace(pol, draft_tokens=0) and first.draft_pass(8) is None
    gc = GenerationConfig(max_new_tokens=4, prefill_chunk=32, stop_at_eos=False)
    assert past.budget_note([70])  # capacity_floor=24 of a 70-token prompt: more than 10%
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = generate(m, _prompts((70,)), gc, policy=past)
    assert out.stats["draft"]["tokens"] == [12] and len(out.tokens[0]) == 4
    # the first pass's BudgetWarning is the run's own note: given once, not once per pass
    notes = [w for w in caught if issubclass(w.category, BudgetWarning)]
    assert [str(w.message) for w in notes] == [past.budget_note([70])]
    with pytest.raises(PolicyError, match="draft_past_answer=True needs draft_tokens"):
        generate(m, [[1, 2, 3]], gc, policy=Lab(**SMALL, draft_past_answer=True))


def test_q_maskahead_draft_is_q_maskahead_qa_with_a_96_token_draft_and_mean_max_rows():
    pol = make("q-maskahead-draft", 20)
    assert pol.label == "q-maskahead-draft" and pol.head_alloc == "adakv" and pol.storage.bits == 4
    n, first = pol.draft_pass()
    assert n == 96 and first.draft_tokens == 0 and first.draft_pass() is None
    assert pol.eviction.prefill.probe.draft and not first.eviction.prefill.probe.draft
    assert pol.eviction.prefill.probe.pool == pol.eviction.schedule.probe.pool == "mean+max"
    qa = make("q-maskahead-qa", 20, draft_tokens=96, question_pool="mean+max")
    assert pol.eviction == qa.eviction and pol.selector == qa.selector
    assert not hasattr(pol.eviction.prefill.probe, "draft_probe")  # a lab knob (experiments/qa_lab.py)
    lab = make("q-maskahead-draft-lab", 20, draft_probe="interleaved")
    assert lab.eviction.prefill.probe.draft_probe == "interleaved" and lab.label == "q-maskahead-draft-lab"
    lab0 = dataclasses.replace(make("q-maskahead-draft-lab", 20), storage=pol.storage).eviction
    for part, want in ((lab0.prefill.probe, pol.eviction.prefill.probe), (lab0.schedule.probe, pol.eviction.schedule.probe)):
        assert isinstance(part, type(want)) and all(getattr(part, f.name) == getattr(want, f.name)
                                                    for f in dataclasses.fields(want))


def test_step0_weight_scales_the_block_evictions_step0_mass():
    """LabDeferred.step0_weight w (experiments/qa_lab.py): a block eviction with step-0 mass M keeps what the released rule
    (w = 1) keeps with mass w x M; w = 0 ranks by the probe alone. `step0_weight` reaches it."""
    from maskahead_jax.cache.float_cache import empty
    from maskahead_jax.policies.eviction import Budget, ForcedKeeps
    from maskahead_jax.policies.scorers import ValueScore

    L, B, H, N, D = 2, 2, 2, 40, 8
    rng = np.random.RandomState(0)
    k, v = (jnp.asarray(rng.randn(L, B, H, N, D), jnp.float32) for _ in range(2))
    cache = empty(L, B, H, N, D, jnp.float32).append(k, v, jnp.broadcast_to(jnp.arange(N), (B, N)),
                                                      jnp.full((B,), N, jnp.int32))
    mass = jnp.asarray(rng.rand(L, B, H, N), jnp.float32)
    probe_mass = jnp.asarray(rng.rand(L, B, H, N), jnp.float32)

    @dataclasses.dataclass(frozen=True)
    class FixedProbe:
        def mass(self, cache, ctx):
            return probe_mass

        def span(self, cache, ctx):
            return jnp.zeros(cache.valid.shape, bool)

    def kept(w, m):
        ev = Eviction(Budget(pct=25.0, floor=4), ValueScore(), ForcedKeeps(sinks=0, recent=0),
                      LabDeferred(1, FixedProbe(), step0_weight=w))
        ctx = StepContext(forward=None, prompt=None, plen=None, n_pre=None, block_size=4, mask_id=0,
                          capacity=N, active=jnp.ones((B,), bool), due=jnp.ones((B,), bool), mass=m)
        out, done, _ = ev.at_block(cache, ctx)
        assert bool(done)
        return np.where(np.asarray(out.valid), np.asarray(out.pos), -1)

    assert np.array_equal(kept(0.0, mass), kept(1.0, jnp.zeros_like(mass)))
    assert np.array_equal(kept(3.0, mass), kept(1.0, 3.0 * mass))
    assert not np.array_equal(kept(0.0, mass), kept(1.0, mass))
    assert Lab(**SMALL, step0_weight=0.0).eviction.schedule.step0_weight == 0.0
    first = Lab(**SMALL, first_block_probe="question")
    assert first.eviction.schedule.first_probe == first.eviction.prefill.probe == LabQuestion(128, 3)
    assert first.first_block_special and not QuestionAwareMaskAhead(**SMALL).first_block_special


def test_policy_parts_and_knobs():
    ev = QuestionAwareMaskAhead(**SMALL).eviction
    assert ev.schedule.probe == QuestionLookahead(128, 3, 3.0) and not ev.schedule.pin_probe and ev.schedule.first_probe is None
    assert ev.bounded_prefill and ev.prefill.probe == Question(128, 3) and not ev.prefill.pin
    pinned = QuestionAwareMaskAhead(**SMALL, pin_question=True).eviction
    assert pinned.schedule.pin_probe and pinned.prefill.pin
    assert not QuestionAwareMaskAhead(**SMALL).first_block_special
    # question_every=False, bounded_prefill=False is the released schedule + first-eviction question
    first = QuestionAwareMaskAhead(**SMALL, question_tokens=16, question_every=False, bounded_prefill=False,
                                   pin_question=True)
    assert first.eviction == MaskAhead(**SMALL, question_tokens=16, pin_question=True).eviction
    assert make("maskahead-qa", 10, question_weight=1.5).eviction.schedule.probe.weight == 1.5


def test_pooled_eviction_scores_are_a_max_over_valid_neighbours():
    """evict_pool=k: MaskAhead's value score, then per lane the max over the k centred slots
    (numpy loop), invalid slots neither scored nor lending their score; through generate, the
    pooled policy runs and keeps what its budget says."""
    from maskahead_jax.cache import empty
    from maskahead_jax.policies.scorers import Pooled, ValueScore

    rng = np.random.RandomState(0)
    L, B, H, N, D = 1, 2, 1, 9, 4
    c = empty(L, B, H, N, D, jnp.float32)
    valid = np.ones((L, B, H, N), bool)
    valid[0, 1, 0, 6:] = False
    c = c._replace(v=jnp.asarray(rng.randn(L, B, H, N, D), jnp.float32), valid=jnp.asarray(valid))
    mass = jnp.asarray(rng.rand(L, B, H, N), jnp.float32) * valid
    ev = MaskAhead(**SMALL, evict_pool=3).eviction
    assert ev.scorer == Pooled(ValueScore(), 3) and ev.scorer.reads_mass
    base = np.asarray(ValueScore().scores(c, mass, None))
    got = np.asarray(ev.scorer.scores(c, mass, None))
    for b in range(B):
        for i in range(N):
            if not valid[0, b, 0, i]:
                assert got[0, b, 0, i] == -np.inf
                continue
            nb = [j for j in (i - 1, i, i + 1) if 0 <= j < N and valid[0, b, 0, j]]
            assert got[0, b, 0, i] == pytest.approx(max(base[0, b, 0, j] for j in nb), rel=1e-6)
    assert MaskAhead(**SMALL).eviction.scorer == ValueScore()  # off by default
    with pytest.raises(PolicyError, match="evict_pool must be positive"):
        MaskAhead(**SMALL, evict_pool=0).validate(None, None)


def test_allocation_spreads_the_row_budget_over_layers_and_heads():
    """eviction.Allocation: MaskKV's layer split (Eq. 9-13 from the importances) and AdaKV's head
    split of the row budget; per layer the heads keep Hkv x C_l in all, each at least its floor and
    its forced keeps; Eviction.evict keeps each lane's top entries by those counts."""
    from maskahead_jax.cache import empty
    from maskahead_jax.policies.eviction import Allocation
    from maskahead_jax.policies.budgets import layer_budgets

    rng = np.random.RandomState(1)
    L, B, H, N, D = 3, 2, 4, 40, 4
    valid = np.ones((L, B, H, N), bool)
    scores = rng.rand(L, B, H, N).astype(np.float32)
    scores[:, :, 0] *= 5  # head 0 holds the layer's top scores
    forced = np.zeros_like(valid)
    forced[..., -2:] = True
    keep = jnp.asarray([30, 26], jnp.int32)
    imp = (3.0, 1.0, 1.0)
    a = Allocation(imp, beta=0.4, heads="adakv", floor_alpha=0.25, lane_cap=3.0)
    k = np.asarray(a.counts(keep, jnp.asarray(scores), jnp.asarray(valid), jnp.asarray(forced)))
    kl = np.asarray(layer_budgets(np.asarray(keep) * L, imp, 0.4))  # [L, B]
    assert (kl.sum(0) == L * np.asarray(keep)).all() and kl[0, 0] > kl[1, 0]
    np.testing.assert_array_equal(k.sum(-1), H * kl)  # no lane hit its cap here
    assert (k[:, :, 0] > k[:, :, 1:].max(-1)).all()  # the head with the top scores keeps most
    assert (k >= np.floor(0.25 * kl)[..., None]).all() and (k >= 2).all()
    uniform = Allocation()
    assert not uniform.ragged and uniform.buffer(10) == 10 and a.buffer(10) == 30
    # Eviction.evict with the allocation: each lane keeps its k top entries
    ev = dataclasses.replace(MaskAhead(**SMALL).eviction, allocation=a)
    c = empty(L, B, H, N, D, jnp.float32)
    c = c._replace(v=jnp.asarray(rng.randn(L, B, H, N, D), jnp.float32), valid=jnp.asarray(valid),
                   pos=jnp.broadcast_to(jnp.arange(N), (L, B, H, N)).astype(jnp.int32),
                   length=jnp.asarray([N, N], jnp.int32), seen=jnp.asarray([N, N], jnp.int32))
    mass = jnp.asarray(scores)
    sc, forced_real = ev.scorer.scores(c, mass, None), ev.keeps.mask(c)
    want = np.asarray(a.counts(keep, jnp.where(forced_real, jnp.inf, sc), c.valid, forced_real))
    out = ev.evict(c, mass, None, keep, 40)
    kept = np.asarray(out.valid)
    np.testing.assert_array_equal(kept.sum(-1), want)
    np.testing.assert_array_equal(want.sum(-1), H * kl)
    s_np, f_np, pos_out = np.asarray(sc), np.asarray(forced_real), np.asarray(out.pos)
    for l, b, h in np.ndindex(L, B, H):  # each lane: its forced keeps, then its top scores
        s_lane = np.where(f_np[l, b, h], np.inf, s_np[l, b, h])
        top = np.sort(np.argsort(-s_lane, kind="stable")[: want[l, b, h]])
        assert pos_out[l, b, h][kept[l, b, h]].tolist() == top.tolist()
    with pytest.raises(PolicyError, match="head_alloc must be one of"):
        Allocation(heads="pyramid")
    with pytest.raises(PolicyError, match="layer_importance has 2 values"):
        MaskAhead(**SMALL, layer_importance=(1.0, 2.0)).validate(tiny_model("sdar", num_layers=3).config, None)


@pytest.mark.parametrize("knobs", [dict(head_alloc="adakv", alloc_floor=1.0),
                                   dict(layer_importance=(2.0, 1.0, 1.0), alloc_beta=1.0)])
def test_degenerate_allocations_equal_the_uniform_rule(knobs):
    """The ragged path with settings that give every lane C (AdaKV floor 1, MaskKV beta 1) ==
    MaskAhead's one-C-per-lane rule, token for token, through generate; a real split runs and
    holds about the same memory (the row budget is the same, only its split differs)."""
    m = tiny_model("sdar", num_layers=3)
    gc = GenerationConfig(max_new_tokens=48, prefill_chunk=32, stop_at_eos=False)
    base = QuestionAwareMaskAhead(**SMALL, question_tokens=12)
    plain = generate(m, _prompts(), gc, policy=base)
    same = generate(m, _prompts(), gc, policy=dataclasses.replace(base, **knobs))
    assert same.tokens == plain.tokens
    assert same.stats["evictions"] == plain.stats["evictions"] >= 2
    if "layer_importance" in knobs:  # a real split (both kinds) runs and holds about the same memory
        split = generate(m, _prompts(), gc, policy=dataclasses.replace(base, head_alloc="adakv",
                                                                       layer_importance=(2.0, 1.0, 1.0)))
        assert all(len(t) == 48 for t in split.tokens)
        for a, b in zip(split.stats["reduction_final"], plain.stats["reduction_final"]):
            assert 0.7 * b <= a <= 1.3 * b


def test_full_budget_equals_dense():
    m = tiny_model("sdar", num_layers=3)
    prompts = _prompts()
    gc = GenerationConfig(max_new_tokens=40, prefill_chunk=32, stop_at_eos=False)
    dense = generate(m, prompts, gc)
    out = generate(m, prompts, gc, policy=QuestionAwareMaskAhead(**FULL, question_tokens=16))
    assert out.tokens == dense.tokens


def _value_ranking_keeps(rec) -> dict:
    """numpy: per lane, the `keep` valid entries with the highest A_i * ||v_i - c|| (forced and
    pinned first), A = mass0 + probe, c = sum A v / sum A."""
    pos, valid, v, a, forced, keep = rec
    out = {}
    for l, b, h in np.ndindex(*pos.shape[:3]):
        ai, vi = a[l, b, h].astype(np.float64), v[l, b, h].astype(np.float64)
        c = (ai[:, None] * vi).sum(0) / max(ai.sum(), 1e-30)
        s = ai * np.linalg.norm(vi - c, axis=-1)
        s = np.where(forced[l, b, h], np.inf, s)
        s = np.where(valid[l, b, h], s, -np.inf)
        order = np.argsort(-s, kind="stable")[: int(keep[b])]
        out[(l, b, h)] = sorted(int(pos[l, b, h, i]) for i in order)
    return out


def test_every_eviction_pins_the_question_and_keeps_the_value_ranking():
    m = tiny_model("sdar", num_layers=3)
    prompts = _prompts()
    # 4 denoising steps per 8-token block: the eager run's cost is its steps; the evictions are per block
    gc = GenerationConfig(max_new_tokens=48, prefill_chunk=32, steps_per_block=4, stop_at_eos=False)
    calls = []

    @dataclasses.dataclass(frozen=True)
    class RecordingEviction(Eviction):
        def evict(self, cache, mass0, probe_mass, keep, capacity, pinned=None):
            out = super().evict(cache, mass0, probe_mass, keep, capacity, pinned=pinned)
            forced = np.asarray(self.keeps.mask(cache)) | (np.asarray(pinned) & np.asarray(cache.valid)
                                                           if pinned is not None else False)
            a = np.asarray(probe_mass if mass0 is None else mass0 + probe_mass, np.float64)
            rec = (np.asarray(cache.pos), np.asarray(cache.valid), np.asarray(cache.values(), np.float64),
                   a, forced, np.asarray(keep))
            kept = {}
            pos, val = np.asarray(out.pos), np.asarray(out.valid)
            for l, b, h in np.ndindex(*pos.shape[:3]):
                kept[(l, b, h)] = sorted(int(p) for p in pos[l, b, h][val[l, b, h]])
            calls.append((pinned is not None, rec, kept))
            return out

    @dataclasses.dataclass(frozen=True)
    class Recording(QuestionAwareMaskAhead):
        @property
        def eviction(self):
            ev = super().eviction
            return RecordingEviction(**{f.name: getattr(ev, f.name) for f in dataclasses.fields(ev)})

    q = 12
    for bounded in (False, True):
        calls.clear()
        pol = Recording(**SMALL, question_tokens=q, bounded_prefill=bounded, pin_question=True)
        with jax.disable_jit():  # eager: each eviction runs once, in order
            out = generate(m, prompts, gc, policy=pol, jit=False)
        assert len(calls) >= 3 and all(p for p, _, _ in calls)  # every eviction pins the question
        for pinned, rec, kept in calls:
            assert kept == _value_ranking_keeps(rec)
            pos, valid = rec[0], rec[1]
            for (l, b, h), k in kept.items():
                span = {int(p) for p in pos[l, b, h][valid[l, b, h]] if (150, 97)[b] - q <= p < (150, 97)[b]}
                assert span <= set(k)
        assert out.stats["evictions"] >= 2
        assert min(out.stats["reduction_final"]) > 1.0


def test_bounded_prefill_bounds_the_peak():
    m = tiny_model("sdar", num_layers=3)
    prompts = _prompts()
    gc = GenerationConfig(max_new_tokens=32, prefill_chunk=32, stop_at_eos=False)
    qa = generate(m, prompts, gc, policy=QuestionAwareMaskAhead(**SMALL, question_tokens=12))
    released_schedule = generate(m, prompts, gc, policy=QuestionAwareMaskAhead(**SMALL, question_tokens=12,
                                                                               bounded_prefill=False))
    plain = generate(m, prompts, gc, policy=MaskAhead(**SMALL))
    assert max(qa.stats["kv_bytes_peak"]) < 0.6 * max(plain.stats["kv_bytes_peak"])
    assert released_schedule.stats["kv_bytes_peak"] == plain.stats["kv_bytes_peak"]  # the whole prompt
    for s in (qa.stats, released_schedule.stats):
        assert all(f <= p for f, p in zip(s["kv_bytes_final"], s["kv_bytes_peak"]))


def test_prefill_slack_keeps_more_while_prefilling_and_nothing_more_after():
    """prefill_slack x C(seen) is kept by bounded prefill: the peak grows with the slack by the
    same step, the end memory does not (the first block evicts to C); a slack no prompt reaches
    is the released schedule exactly (same tokens, same bytes)."""
    m = tiny_model("sdar", num_layers=3)
    prompts = _prompts()
    gc = GenerationConfig(max_new_tokens=32, prefill_chunk=32, stop_at_eos=False)
    runs = {s: generate(m, prompts, gc, policy=Lab(**SMALL, question_tokens=12, prefill_slack=s))
            for s in (1.0, 2.0, 3.0, 100.0)}
    peak = {s: runs[s].stats["kv_bytes_peak"][0] for s in runs}
    assert peak[1.0] < peak[2.0] < peak[3.0]
    assert peak[3.0] - peak[2.0] == peak[2.0] - peak[1.0]  # one C(seen) of entries per unit of slack
    for s in runs:
        assert runs[s].stats["kv_bytes_final"] == runs[1.0].stats["kv_bytes_final"]
    released = generate(m, prompts, gc, policy=QuestionAwareMaskAhead(**SMALL, question_tokens=12,
                                                                       bounded_prefill=False))
    assert [list(t) for t in runs[100.0].tokens] == [list(t) for t in released.tokens]
    assert runs[100.0].stats["kv_bytes_peak"] == released.stats["kv_bytes_peak"]
    product = generate(m, prompts, gc, policy=QuestionAwareMaskAhead(**SMALL, question_tokens=12))
    assert [list(t) for t in runs[1.0].tokens] == [list(t) for t in product.tokens]  # lab defaults = product
    assert runs[1.0].stats["kv_bytes_peak"] == product.stats["kv_bytes_peak"]
    with pytest.raises(PolicyError, match="prefill_slack must be >= 1"):
        generate(m, prompts, gc, policy=Lab(**SMALL, prefill_slack=0.5))


def test_prefill_budget_prompt_keeps_the_whole_prompts_budget_from_the_first_chunk():
    """prefill_budget="prompt": bounded prefill ranks every chunk against C(stored prompt), not
    C(seen so far): a higher peak (C(prompt) + a chunk instead of C(seen) + a chunk) and the same
    end memory (the first block evicts to C(seen))."""
    m = tiny_model("sdar", num_layers=2)
    gc = GenerationConfig(max_new_tokens=8, prefill_chunk=32, stop_at_eos=False)
    knobs = dict(SMALL, capacity_pct=40, question_tokens=12)
    run = lambda b: generate(m, _prompts(), gc, policy=Lab(**knobs, prefill_budget=b))
    seen, whole = run("seen"), run("prompt")
    assert all(w > s for w, s in zip(whole.stats["kv_bytes_peak"], seen.stats["kv_bytes_peak"]))
    assert whole.stats["kv_bytes_final"] == seen.stats["kv_bytes_final"]
    with pytest.raises(PolicyError, match="prefill_budget must be seen|prompt"):
        Lab(**SMALL, prefill_budget="all").eviction


def test_bad_settings_are_clear_errors():
    m = tiny_model("sdar")
    gc = GenerationConfig(max_new_tokens=8)
    with pytest.raises(PolicyError, match="question_tokens must be positive"):
        generate(m, [[1, 2, 3]], gc, policy=QuestionAwareMaskAhead(**SMALL, question_tokens=0))
    with pytest.raises(PolicyError, match="lookahead_blocks >= 2"):
        generate(m, [[1, 2, 3]], gc, policy=QuestionAwareMaskAhead(**dict(SMALL, lookahead_blocks=1)))
    with pytest.raises(PolicyError, match="step0_weight must be >= 0"):
        generate(m, [[1, 2, 3]], gc, policy=Lab(**SMALL, step0_weight=-1))
    with pytest.raises(PolicyError, match="first_block_probe must be"):
        generate(m, [[1, 2, 3]], gc, policy=Lab(**SMALL, first_block_probe="x"))
    with pytest.raises(PolicyError, match="hide_question must be one of"):
        generate(m, [[1, 2, 3]], gc, policy=Lab(**SMALL, hide_question="some"))
    with pytest.raises(PolicyError, match="draft_tokens must be >= 0"):
        generate(m, [[1, 2, 3]], gc, policy=QuestionAwareMaskAhead(**SMALL, draft_tokens=-1))
    with pytest.raises(PolicyError, match="draft_tokens needs bounded_prefill=True"):
        generate(m, [[1, 2, 3]], gc, policy=QuestionAwareMaskAhead(**SMALL, draft_tokens=4, bounded_prefill=False))
    with pytest.raises(PolicyError, match="draft_probe must be tokens"):
        generate(m, [[1, 2, 3]], gc, policy=Lab(**SMALL, draft_tokens=4, draft_probe="masks"))
    with pytest.raises(PolicyError, match="draft_capacity_pct=30 needs draft_tokens > 0"):
        generate(m, [[1, 2, 3]], gc, policy=Lab(**SMALL, draft_capacity_pct=30))
    with pytest.raises(PolicyError, match="draft_capacity_pct must be in"):
        generate(m, [[1, 2, 3]], gc, policy=Lab(**SMALL, draft_tokens=4, draft_capacity_pct=130))
    with pytest.raises(ValueError, match="needs a block-causal model"):
        generate(tiny_model("llada"), [[1, 2, 3]], gc, policy=QuestionAwareMaskAhead(**SMALL, draft_tokens=4))
    with pytest.raises(PolicyError, match="question_pool must be one of"):
        generate(m, [[1, 2, 3]], gc, policy=QuestionAwareMaskAhead(**SMALL, question_pool="sum"))
    with pytest.raises(PolicyError, match="question_weight must be >= 0"):
        generate(m, [[1, 2, 3]], gc, policy=QuestionAwareMaskAhead(**SMALL, question_weight=-1))


def test_deferred_final_chunk_leaves_the_last_chunk_to_the_first_block():
    """defer_final_chunk: bounded prefill never compacts after the prompt's final chunk, so a
    prompt of one chunk runs the released schedule exactly; longer prompts keep bounded
    prefill's peak (C + one chunk) and its end memory."""
    m = tiny_model("sdar", num_layers=3)
    gc = GenerationConfig(max_new_tokens=32, prefill_chunk=256, stop_at_eos=False)
    one_chunk = _prompts()  # 150 and 97 tokens: one 256-token chunk each
    pol = lambda **kw: Lab(**SMALL, question_tokens=12, **kw)
    deferred = generate(m, one_chunk, gc, policy=pol(defer_final_chunk=True))
    released = generate(m, one_chunk, gc, policy=pol(bounded_prefill=False))
    assert [list(t) for t in deferred.tokens] == [list(t) for t in released.tokens]
    assert deferred.stats["kv_bytes_peak"] == released.stats["kv_bytes_peak"]
    gc = dataclasses.replace(gc, prefill_chunk=32)
    deferred = generate(m, one_chunk, gc, policy=pol(defer_final_chunk=True))
    bounded = generate(m, one_chunk, gc, policy=pol())
    assert deferred.stats["kv_bytes_final"] == bounded.stats["kv_bytes_final"]
    assert max(deferred.stats["kv_bytes_peak"]) <= max(bounded.stats["kv_bytes_peak"])
    assert max(deferred.stats["kv_bytes_peak"]) < 0.8 * max(released.stats["kv_bytes_peak"])
