"""The commit rules of maskahead_jax.decoding, each on its own against hand-worked examples.

No model and no engine: every test builds a block and logits whose confidences are chosen by
hand (`_logits`), calls `decoding.commit` step by step and checks which positions the rule fills,
as worked out on paper from the families' released generate functions (fast_dllm: Fast-dLLM v2's
batch_sample; dynamic: SDAR's block_diffusion_generate / LLaDA2.0's generate, count from the
block length; dream_reasoner: the released MaskAhead DreamReasoner driver; llada: LLaDA's
generate, count from the block's initial masks).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maskahead_jax import decoding
from maskahead_jax.config import GenerationConfig, ModelConfig, ResolvedGeneration

V = 8  # vocabulary: tokens 0..6, the mask is 7
M = V - 1
KEY = jax.random.key(0)


def _gen(rule, block=8, steps=None, threshold=0.9, sub=None) -> ResolvedGeneration:
    return ResolvedGeneration(block_size=block, sub_block_size=sub or block, commit_rule=rule,
                              threshold=threshold, steps_per_block=steps or block, max_new_tokens=64,
                              prefill_chunk=512, max_prompt_len=4096, prompt_refresh=0, temperature=0.0,
                              top_p=1.0, stop_at_eos=True)


def _logits(tokens, confs):
    """[1, Bs, V] logits whose softmax (mask logit dropped) puts confs[j] on tokens[j] and spreads
    the rest evenly over the other five non-mask tokens (so tokens[j] is the argmax when conf > 1/6).
    The mask token gets the largest logit of all: it must never be proposed."""
    p = np.zeros((len(tokens), V), np.float64)
    for j, (t, c) in enumerate(zip(tokens, confs)):
        p[j, :M] = (1.0 - c) / (M - 1)
        p[j, t] = c
    with np.errstate(divide="ignore"):  # conf 0 on unmasked positions: their logits do not matter
        lg = np.log(p)
    lg[:, M] = 50.0
    return jnp.asarray(lg[None], jnp.float32)


def _step(x, tokens, confs, step, gen, m0=None, active=True):
    x = jnp.asarray([x], jnp.int32)
    m0 = jnp.asarray([int((x == M).sum()) if m0 is None else m0], jnp.int32)
    out = decoding.commit(x, _logits(tokens, confs), jnp.int32(step), m0, jnp.asarray([active]), gen, M, KEY)
    return [int(t) for t in out[0]]


def _filled(before, after):
    """Positions the step filled (and a check that nothing else changed)."""
    changed = [j for j, (a, b) in enumerate(zip(before, after)) if a != b]
    assert all(before[j] == M for j in changed), "an unmasked position was overwritten"
    return changed


GUESS = [3, 4, 5, 6, 0, 1, 2, 3]  # the model's token at each of the 8 positions


# --------------------------------------------------------------------------- propose


def test_propose_never_proposes_the_mask_and_reports_its_probability():
    xhat, conf = decoding.propose(_logits(GUESS, [0.95, 0.5, 0.3, 0.2, 0.99, 0.6, 0.4, 0.25]), _gen("llada"), KEY, M)
    assert xhat[0].tolist() == GUESS
    np.testing.assert_allclose(conf[0], [0.95, 0.5, 0.3, 0.2, 0.99, 0.6, 0.4, 0.25], rtol=1e-5)


def test_shift_logits_reads_the_previous_position():
    lg = jnp.arange(2 * 3 * 2, dtype=jnp.float32).reshape(2, 3, 2)
    prev = jnp.full((2, 2), -1.0)
    out = decoding.shift_logits(lg, prev)
    np.testing.assert_array_equal(out[:, 0], prev)
    np.testing.assert_array_equal(out[:, 1:], lg[:, :-1])


# --------------------------------------------------------------------------- fast_dllm


def test_fast_dllm_works_inside_the_first_sub_block_with_masks():
    """Block 8, sub-blocks of 4, threshold 0.9. Prompt tail [1, 2]; sub-block 0 = positions 0-3."""
    g = _gen("fast_dllm", sub=4)
    confs = [0.0, 0.0, 0.5, 0.95, 0.99, 0.99, 0.3, 0.99]
    x = [1, 2, M, M, M, M, M, M]
    # step 0: candidates 2, 3 only (sub-block 0); 3 is above 0.9 -> only 3 (the best is 3 too)
    x1 = _step(x, GUESS, confs, 0, g)
    assert _filled(x, x1) == [3] and x1[3] == GUESS[3]
    # step 1: candidate 2 alone, below the threshold: the single most confident is always taken
    x2 = _step(x1, GUESS, confs, 1, g)
    assert _filled(x1, x2) == [2]
    # step 2: sub-block 1 (4-7): 4, 5, 7 above 0.9, 6 not
    x3 = _step(x2, GUESS, confs, 2, g)
    assert _filled(x2, x3) == [4, 5, 7]
    # step 3: 6 alone (0.3) -> best
    x4 = _step(x3, GUESS, confs, 3, g)
    assert _filled(x3, x4) == [6] and x4 == [1, 2] + GUESS[2:]


def test_fast_dllm_without_any_confident_token_takes_the_best_and_ties_go_low():
    g = _gen("fast_dllm", sub=8)
    x = [M] * 8
    assert _filled(x, _step(x, GUESS, [0.3, 0.5, 0.4, 0.5, 0.2, 0.5, 0.1, 0.3], 0, g)) == [1]


def test_fast_dllm_threshold_is_strict():
    confs = [0.5, 0.5, 0.6, 0.2, 0.2, 0.2, 0.7, 0.2]
    _, conf = decoding.propose(_logits(GUESS, confs), _gen("fast_dllm"), KEY, M)
    g = _gen("fast_dllm", threshold=float(conf[0, 0]))  # exactly the confidence of positions 0 and 1
    x = [M] * 8
    assert _filled(x, _step(x, GUESS, confs, 0, g)) == [2, 6]


# --------------------------------------------------------------------------- dynamic (SDAR / LLaDA2.0)


def test_dynamic_commits_everything_above_the_threshold_when_that_covers_the_schedule():
    g = _gen("dynamic", steps=8)  # 8 / 8: one token per step
    x = [M] * 8
    confs = [0.95, 0.3, 0.92, 0.5, 0.99, 0.2, 0.1, 0.91]
    assert _filled(x, _step(x, GUESS, confs, 0, g)) == [0, 2, 4, 7]


def test_dynamic_falls_back_to_the_scheduled_top_k():
    x = [M] * 8
    confs = [0.3, 0.8, 0.95, 0.5, 0.7, 0.2, 0.1, 0.6]
    # steps 8: 1 per step; 0.95 >= 1 above -> it alone
    assert _filled(x, _step(x, GUESS, confs, 0, _gen("dynamic", steps=8))) == [2]
    # steps 4: 2 per step; 1 above < 2 -> top-2 by confidence: 2 (0.95) and 1 (0.8)
    assert _filled(x, _step(x, GUESS, confs, 0, _gen("dynamic", steps=4))) == [1, 2]
    # steps 2: 4 per step -> top-4: 2, 1, 4 (0.7), 7 (0.6)
    assert _filled(x, _step(x, GUESS, confs, 0, _gen("dynamic", steps=2))) == [1, 2, 4, 7]
    # none above at all, steps 8 -> the single best
    low = [0.3, 0.8, 0.85, 0.5, 0.7, 0.2, 0.1, 0.6]
    assert _filled(x, _step(x, GUESS, low, 0, _gen("dynamic", steps=8))) == [2]


def test_dynamic_commits_at_least_one_token_when_the_schedule_says_zero():
    """Block 4, 8 steps: the schedule is 1, 1, 1, 1, 0, 0, 0, 0; a step past it with masks left and
    nothing above the threshold still commits the best one (the engine never stalls)."""
    g = _gen("dynamic", block=4, steps=8)
    x = [M, M, 1, 2]
    assert _filled(x, _step(x, GUESS[:4], [0.3, 0.4, 0.0, 0.0], 5, g)) == [1]


def test_dynamic_schedule_counts_from_the_block_length():
    """The issue-37 case: block 8, 4 steps, a block that starts with 3 prompt tokens (5 masks), no
    token ever above the threshold. SDAR / LLaDA2.0: 8 // 4 = 2 per step -> 2, 2, 1 (done after 3
    steps). LLaDA's split of the 5 masks would be 2, 1, 1, 1."""
    g = _gen("dynamic", steps=4)
    confs = [0.0, 0.0, 0.0, 0.5, 0.8, 0.3, 0.7, 0.6]
    x0 = [1, 2, 3, M, M, M, M, M]
    x1 = _step(x0, GUESS, confs, 0, g, m0=5)
    assert _filled(x0, x1) == [4, 6]  # 0.8, 0.7
    x2 = _step(x1, GUESS, confs, 1, g, m0=5)
    assert _filled(x1, x2) == [3, 7]  # 0.6, 0.5
    x3 = _step(x2, GUESS, confs, 2, g, m0=5)
    assert _filled(x2, x3) == [5]  # two scheduled, one mask left: only it, the prompt tail untouched
    assert x3 == [1, 2, 3] + GUESS[3:]


def test_llada_schedule_counts_from_the_initial_masks():
    """Same block under LLaDA's rule: 5 masks over 4 steps -> 2, 1, 1, 1 (top-k, no threshold)."""
    g = _gen("llada", steps=4)
    confs = [0.0, 0.0, 0.0, 0.5, 0.8, 0.3, 0.7, 0.6]
    x, order = [1, 2, 3, M, M, M, M, M], []
    for step in range(4):
        y = _step(x, GUESS, confs, step, g, m0=5)
        order.append(_filled(x, y))
        x = y
    assert order == [[4, 6], [7], [3], [5]]


def test_llada_ignores_the_threshold():
    """Block 4, 2 steps, 4 masks: 2 per step even with three tokens above the threshold."""
    g = _gen("llada", block=4, steps=2)
    x = [M] * 4
    assert _filled(x, _step(x, GUESS[:4], [0.99, 0.98, 0.97, 0.2], 0, g)) == [0, 1]


@pytest.mark.parametrize("rule", ["dynamic", "dream_reasoner", "llada"])
def test_schedules_agree_when_steps_equal_the_block_size(rule):
    """steps = block size (the default): every basis gives one token per step while masks remain,
    so the token-by-token result is what it was before the basis was the rule's own."""
    for bs in (4, 8, 32):
        for m0 in range(bs + 1):
            for step in range(bs):
                n = decoding.schedule_total(rule, jnp.asarray([m0]), bs)
                k = jnp.maximum(decoding.scheduled_count(n, jnp.int32(step), bs), 1)
                k_masks = jnp.maximum(decoding.scheduled_count(jnp.asarray([m0]), jnp.int32(step), bs), 1)
                assert int(k[0]) == int(k_masks[0]) == 1


def test_schedule_basis_per_family_rule():
    assert decoding.SCHEDULE_BASIS == {"dynamic": "block", "dream_reasoner": "block", "llada": "masks"}
    from maskahead_jax.config import FAMILY_DEFAULTS
    rules = {f: d.commit_rule for f, d in FAMILY_DEFAULTS.items()}
    assert rules["sdar"] == rules["llada2"] == "dynamic" and rules["dream_reasoner"] == "dream_reasoner"
    assert rules["llada"] == "llada"


# --------------------------------------------------------------------------- dream_reasoner


def test_dream_reasoner_is_dynamic_until_the_last_step_which_accepts_everything():
    confs = [0.3, 0.8, 0.95, 0.5, 0.7, 0.2, 0.1, 0.6]
    x = [M] * 8
    dyn, dr = _gen("dynamic", steps=4), _gen("dream_reasoner", steps=4)
    for step in range(3):
        assert _step(x, GUESS, confs, step, dr) == _step(x, GUESS, confs, step, dyn)
    assert _filled(x, _step(x, GUESS, confs, 3, dyn)) == [1, 2]
    assert _filled(x, _step(x, GUESS, confs, 3, dr)) == list(range(8))  # force-accept at step S - 1
    y = [1, M, 2, M, 3, 4, 5, 6]
    assert _filled(y, _step(y, GUESS, confs, 3, dr)) == [1, 3]  # only masks, the rest untouched


# --------------------------------------------------------------------------- rows


def test_inactive_rows_and_rows_without_masks_are_left_alone():
    confs = [0.99] * 8
    x = [M] * 8
    for rule in ("fast_dllm", "dynamic", "dream_reasoner", "llada"):
        assert _step(x, GUESS, confs, 0, _gen(rule), active=False) == x
        done = list(GUESS)
        assert _step(done, [0] * 8, confs, 0, _gen(rule)) == done


def test_rows_of_a_batch_follow_their_own_masks():
    """Two rows, dynamic, block 8, 4 steps (2 per step): row 0 has 1 mask left, row 1 has 8."""
    g = _gen("dynamic", steps=4)
    x = jnp.asarray([[1, 2, 3, 4, 5, 6, 0, M], [M] * 8], jnp.int32)
    lg = jnp.concatenate([_logits(GUESS, [0.3] * 8), _logits(GUESS, [0.3, 0.8, 0.95, 0.5, 0.7, 0.2, 0.1, 0.6])])
    out = decoding.commit(x, lg, jnp.int32(3), jnp.asarray([1, 8]), jnp.asarray([True, True]), g, M, KEY)
    assert out[0].tolist() == [1, 2, 3, 4, 5, 6, 0, GUESS[7]]
    assert [j for j in range(8) if int(out[1, j]) != M] == [1, 2]


def test_generation_config_resolves_the_rule_the_schedule_reads():
    cfg = ModelConfig(family="sdar", layout="qwen3", vocab_size=V, hidden_size=8, num_layers=1, num_heads=1,
                      num_kv_heads=1, head_dim=8, intermediate_size=8, mask_token_id=M, block_size=8,
                      commit_rule="dynamic")
    r = GenerationConfig(steps_per_block=4).resolve(cfg)
    assert (r.commit_rule, r.block_size, r.steps_per_block) == ("dynamic", 8, 4)
    assert dataclasses.replace(r, commit_rule="llada").commit_rule == "llada"
