"""Real long rows for the block-causal trainer (experiments/testbed/real_long.py, issue 53): the
tail's logits over the prefix cache are the whole row's two-copy logits there; the rows put the
prompt's end in the tail; the flag is checked; the step trains."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import experiments.train_testbed as tt
from experiments.testbed import real_long as RL
from experiments.testbed.data import make_batch
from experiments.testbed.objective import make_optimizer, two_copy_logits
from maskahead_jax import tasks as T
from maskahead_jax.config import ModelConfig
from maskahead_jax.model.init import init_params
from maskahead_jax.model.rope import RopeScaling
from tiny import tiny_testbed_cfg


def tiny_cfg(**kw) -> ModelConfig:
    """The block-causal testbed layout (SDAR), tiny."""
    return tiny_testbed_cfg(**{"family": "sdar", "attention": "block_causal", **kw})


def _row(key, cfg, n, tail):
    """A random row of n tokens: the clean x0, x_t with masks in the tail only, position ids."""
    k1, k2 = jax.random.split(key)
    x0 = jax.random.randint(k1, (1, n), 4, cfg.vocab_size, jnp.int32)
    masked = (jax.random.uniform(k2, (1, n)) < 0.5) & (jnp.arange(n)[None] >= n - tail)
    return x0, jnp.where(masked, cfg.mask_token_id, x0), masked


@pytest.mark.parametrize("scaling,skip", [(None, False), ("dynamic_yarn", True)])
@pytest.mark.parametrize("shift", [True, False])
def test_tail_logits_equal_the_whole_rows_two_copy_logits_at_the_tail(scaling, skip, shift):
    """The noisy tail reads the clean prefix and tail blocks before it, as the full two-copy layout
    has it; under dynamic_yarn at skip-wise ids the prefix pass gets the whole row's factor."""
    rs = RopeScaling("dynamic_yarn", factor=8.0, original_max_position_embeddings=64) if scaling else None
    cfg = tiny_cfg(rope_scaling=rs, logits_shift=shift)
    params = init_params(cfg, jax.random.PRNGKey(3), jnp.float32)
    n, tail = 192, 64
    x0, xt, _ = _row(jax.random.PRNGKey(4), cfg, n, tail)
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    if skip:  # block-aligned chunks at skipped ids (data.pose_positions' layout), the row ends at 480
        pos = jnp.concatenate([pos[:, :64], pos[:, 64:128] + 160, pos[:, 128:] + 288], 1)
    full = two_copy_logits(params, cfg, xt, x0, chunk=64, pos=pos)[:, n - tail:]
    p = n - tail
    got = RL.tail_logits(params, cfg, x0[:, :p], pos[:, :p], xt[:, p:], x0[:, p:], pos[:, p:])
    np.testing.assert_allclose(got, full, atol=2e-4, rtol=2e-4)


def test_long_step_trains_the_tail_and_leaves_the_prefix_cache_without_gradient():
    cfg = tiny_cfg()
    params = init_params(cfg, jax.random.PRNGKey(5), jnp.float32)
    n, tail = 128, 64
    x0, xt, masked = _row(jax.random.PRNGKey(6), cfg, n, tail)
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    w = jnp.ones((1, n), jnp.float32)
    p = n - tail
    args = (x0[:, :p], pos[:, :p], xt[:, p:], x0[:, p:], masked[:, p:], w[:, p:], pos[:, p:])
    g = jax.grad(lambda q: RL.long_loss(q, cfg, *args)[0])(params)
    assert all(np.isfinite(x).all() for x in jax.tree_util.tree_leaves(g))
    assert float(jnp.abs(g["layers"]["wq"]).sum()) > 0
    # the prefix pass alone takes no gradient: a loss on its cache is constant in the parameters
    gc = jax.grad(lambda q: RL.prefix_cache(q, cfg, args[0], args[1], pos[:, -1:])[0].k.sum())(params)
    assert all(float(jnp.abs(x).sum()) == 0 for x in jax.tree_util.tree_leaves(gc))
    opt = make_optimizer(1e-3)
    step = RL.make_long_step(cfg, opt)
    st = opt.init(params)
    losses = []
    for _ in range(8):
        params, st, loss, _ = step(params, st, *args)
        losses.append(float(loss))
    assert losses[-1] < losses[0]


def test_long_rows_end_the_prompt_inside_the_tail():
    """Task rows only; the first answer token (weight answer_weight) falls in the trained tail in
    nearly every row, the prefix is clean and the tail carries the noise; skip-wise ids with the
    pose flags."""
    tok = T.build_tokenizer()
    spec = RL.parse_real_long("2048:512:4")
    args = tt.build_parser().parse_args(["--pose-target", "8192", "--pose-prob", "0.5", "--pose-min-len", "1024",
                                         "--mqar-prob", "0.5", "--copy-prob", "0.5", "--max-positions", "8256"])
    inside, skipped = 0, 0
    for step in range(12):
        prefix, ppos, xt, x0, masked, w, tpos = RL.make_long_batch(step, 7, tok, args, spec)
        assert prefix.shape == ppos.shape == (1, 1536) and xt.shape == tpos.shape == w.shape == (1, 512)
        assert prefix[0, 0] == T.BOS_ID and (prefix != T.MASK_ID).all()
        assert np.all(np.diff(np.concatenate([ppos, tpos], 1)[0]) >= 1)
        np.testing.assert_array_equal(np.where(masked, T.MASK_ID, x0), xt)
        row_w = make_batch(step, 7, 1, 2048, tok, RL.row_args(args, spec))[3][0]  # the whole row's weights
        np.testing.assert_array_equal(row_w[1536:], w[0])
        ans = np.flatnonzero(row_w == args.answer_weight)
        inside += bool(ans.size) and ans[0] >= 1536
        skipped += int(tpos[0, -1]) > 2047
    assert inside >= 10, inside
    assert 2 <= skipped <= 11, skipped


def test_real_long_flag_is_checked_and_scheduled():
    assert RL.parse_real_long(None) == RL.RealLong() and not RL.RealLong().due(3)
    spec = RL.parse_real_long("8192:512:4")
    assert (spec.length, spec.tail, spec.every, spec.prefix) == (8192, 512, 4, 7680)
    assert [s for s in range(12) if spec.due(s)] == [3, 7, 11]
    for bad in ("8192:512", "8192:500:4", "8192:8192:4", "8192:512:0", "a:b:c"):
        with pytest.raises(SystemExit, match="--real-long"):
            RL.parse_real_long(bad)
    with pytest.raises(SystemExit, match="--real-long"):
        tt.check_data_flags(tt.build_parser().parse_args(["--real-long", "40000:512:4"]))


def test_long_rows_take_their_own_task_mix():
    """--real-long-task-weights / --real-long-edge-depths / --real-long-hard-keys set the long rows'
    mix (the short rows keep theirs); a malformed one fails at startup."""
    from experiments.testbed.data import data_options

    spec = RL.parse_real_long("2048:512:4")
    base = ["--task-weights", "0.1,0.3,0.15,0.25,0.2", "--edge-depths", "0.3", "--real-long", "2048:512:4"]
    args = tt.build_parser().parse_args(base + ["--real-long-task-weights", "0,1,0,0,0", "--real-long-edge-depths", "1",
                                                "--real-long-hard-keys", "1"])
    tt.check_data_flags(args)
    own, short = data_options(RL.row_args(args, spec)), data_options(args)
    assert own["task_weights"] == (0, 1, 0, 0, 0) and own["edge_depths"] == 1.0 and own["hard_keys"] == 1.0
    assert short["edge_depths"] == 0.3 and short["task_weights"][0] == 0.1 and short["hard_keys"] == 0.0
    plain = data_options(RL.row_args(tt.build_parser().parse_args(base), spec))
    assert plain["task_weights"] == short["task_weights"] and plain["edge_depths"] == 0.3
    assert plain["hard_keys"] == 0.0
    tok = T.build_tokenizer()
    for step in range(4):  # every long row is then multi-key with its needle at an end
        x0 = RL.make_long_batch(step, 3, tok, args, spec)[3]
        text = tok.decode(x0[0].tolist())
        assert "special magic number" in text and "pass key" not in text
    with pytest.raises(SystemExit, match="task-weights"):
        tt.check_data_flags(tt.build_parser().parse_args(base + ["--real-long-task-weights", "1,2"]))
    with pytest.raises(SystemExit, match="hard-keys"):
        tt.check_data_flags(tt.build_parser().parse_args(base + ["--real-long-hard-keys", "1.5"]))


def test_long_rows_can_hold_the_most_distractors(monkeypatch):
    """--real-long-most-distractors 1: every long multi-key / document-QA row holds the most keys /
    documents its length allows (the evaluation's 64 / 24 at 8192), not a uniform count; the short
    rows keep the uniform draw; a malformed share fails at startup."""
    from experiments.testbed.data import train_sequence, data_options
    import random

    seen = []
    real_generate = T.generate
    monkeypatch.setattr(T, "generate", lambda task, *a, **kw: seen.append((task, kw)) or real_generate(task, *a, **kw))
    spec = RL.parse_real_long("8192:512:3")
    base = ["--real-long", "8192:512:3", "--real-long-task-weights", "0,0.5,0,0.5,0"]
    args = tt.build_parser().parse_args(base + ["--real-long-most-distractors", "1"])
    tt.check_data_flags(args)
    tok = T.build_tokenizer()
    for step in range(6):
        RL.make_long_batch(step, 5, tok, args, spec)
    assert {t for t, _ in seen} == {"multikey", "docqa"}
    assert all(kw.get("n_keys", 64) == 64 and kw.get("n_docs", 24) == 24 for _, kw in seen)
    seen.clear()
    opts = data_options(RL.row_args(tt.build_parser().parse_args(base), spec))
    assert opts["most_distractors"] == 0.0
    r = random.Random(0)
    for _ in range(12):  # without it the counts are drawn (some below the top)
        train_sequence(r, 8192, tok, 3.0, **opts)
    assert any(kw.get("n_keys", 64) < 64 or kw.get("n_docs", 24) < 24 for _, kw in seen)
    with pytest.raises(SystemExit, match="most-distractors"):
        tt.check_data_flags(tt.build_parser().parse_args(base + ["--real-long-most-distractors", "2"]))


def test_prefix_kv_gradient_keeps_the_loss_and_reaches_the_far_keys():
    """--real-long-prefix-kv-grad: the same logits, and the loss's gradient now also reaches the
    K / V projections through the prefix's keys (a loss on the prefix cache alone is no longer
    constant in them; the rest of the prefix pass stays without gradient)."""
    rs = RopeScaling("dynamic_yarn", factor=8.0, original_max_position_embeddings=64)
    cfg = tiny_cfg(rope_scaling=rs)
    params = init_params(cfg, jax.random.PRNGKey(7), jnp.float32)
    n, tail = 128, 64
    x0, xt, masked = _row(jax.random.PRNGKey(8), cfg, n, tail)
    pos = jnp.arange(n, dtype=jnp.int32)[None] * 3  # far ids: the dynamic factor applies
    w = jnp.ones((1, n), jnp.float32)
    p = n - tail
    args = (x0[:, :p], pos[:, :p], xt[:, p:], x0[:, p:], masked[:, p:], w[:, p:], pos[:, p:])
    plain = RL.tail_logits(params, cfg, *args[:4], args[6])
    with_grad = RL.tail_logits(params, cfg, *args[:4], args[6], grad="kv")
    np.testing.assert_allclose(with_grad, plain, atol=1e-5, rtol=1e-5)
    gc = jax.grad(lambda q: RL.prefix_cache(q, cfg, args[0], args[1], pos[:, -1:], "kv")[0].k.sum())(params)
    assert float(jnp.abs(gc["layers"]["wk"]).sum()) > 0
    assert float(jnp.abs(gc["layers"]["wq"]).sum()) == 0 and float(jnp.abs(gc["embed"]).sum()) == 0
    g0 = jax.grad(lambda q: RL.long_loss(q, cfg, *args)[0])(params)
    g1 = jax.grad(lambda q: RL.long_loss(q, cfg, *args, grad="kv")[0])(params)
    assert not np.allclose(g1["layers"]["wk"], g0["layers"]["wk"])
    np.testing.assert_allclose(g1["layers"]["wq"], g0["layers"]["wq"], atol=1e-6, rtol=1e-4)
    step = RL.make_long_step(cfg, make_optimizer(1e-3), grad="kv")
    out = step(params, make_optimizer(1e-3).init(params), *args)
    assert np.isfinite(float(out[2]))
    with pytest.raises(SystemExit, match="--real-long"):
        tt.check_data_flags(tt.build_parser().parse_args(["--real-long-prefix-kv-grad"]))


def test_full_prefix_gradient_is_the_whole_rows_two_copy_gradient(monkeypatch):
    """--real-long-prefix-full-grad: the tail loss's gradient, every parameter, is the one of the
    same loss on the whole row's two-copy logits (objective.two_copy_logits, the plain reference):
    through every layer of the prefix and the embeddings; skip-wise ids under dynamic_yarn."""
    from experiments.testbed.objective import masked_loss

    rs = RopeScaling("dynamic_yarn", factor=8.0, original_max_position_embeddings=64)
    cfg = tiny_cfg(rope_scaling=rs)
    params = init_params(cfg, jax.random.PRNGKey(9), jnp.float32)
    n, tail = 192, 64
    x0, xt, masked = _row(jax.random.PRNGKey(10), cfg, n, tail)
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    pos = jnp.concatenate([pos[:, :64], pos[:, 64:128] + 160, pos[:, 128:] + 288], 1)
    w = jax.random.uniform(jax.random.PRNGKey(11), (1, n)) + 0.5
    p = n - tail
    args = (x0[:, :p], pos[:, :p], xt[:, p:], x0[:, p:], masked[:, p:], w[:, p:], pos[:, p:])

    def whole(q):
        return masked_loss(two_copy_logits(q, cfg, xt, x0, chunk=64, pos=pos)[:, p:], x0[:, p:], masked[:, p:], w[:, p:])[0]

    monkeypatch.setattr(RL, "PREFIX_CHUNK", 64)  # two query chunks over the 128-token prefix
    ref, g_ref = jax.value_and_grad(whole)(params)
    loss, g = jax.value_and_grad(lambda q: RL.long_loss(q, cfg, *args, grad="full")[0])(params)
    np.testing.assert_allclose(loss, ref, rtol=1e-5)
    for path, a in jax.tree_util.tree_leaves_with_path(g):
        b = g_ref
        for k in path:
            b = b[k.key]
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-3, err_msg=jax.tree_util.keystr(path))
    assert float(jnp.abs(g["embed"]).sum()) > 0 and float(jnp.abs(g["layers"]["wq"]).sum()) > 0
    # the same logits as the pass without gradient
    plain = RL.tail_logits(params, cfg, *args[:4], args[6])
    full = RL.tail_logits(params, cfg, *args[:4], args[6], grad="full")
    np.testing.assert_allclose(full, plain, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="grad must be"):
        RL.prefix_cache(params, cfg, args[0], args[1], pos[:, -1:], "deep")
    with pytest.raises(SystemExit, match="--real-long-prefix-full-grad"):
        tt.check_data_flags(tt.build_parser().parse_args(["--real-long-prefix-full-grad"]))
    assert tt.prefix_grad_mode(tt.build_parser().parse_args(["--real-long-prefix-full-grad"])) == "full"


def test_long_step_benchmark_prints_a_json_line(capsys):
    """experiments/testbed/bench_long_step.py: one mode's line (a child process's work, run here
    in-process on the shipped testbed at a small length); a bad mode is refused by name."""
    import json
    import os

    from experiments.testbed import bench_long_step as B

    model = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "maskahead_jax", "testbed")
    B.main(["--one", "--model", model, "--modes", "full", "--length", "512", "--tail", "128", "--steps", "1"])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["mode"] == "full" and (row["length"], row["tail"]) == (512, 128)
    assert row["step_s"] > 0 and row["peak_rss_gb"] > 0
    with pytest.raises(SystemExit, match="--modes"):
        B.main(["--model", model, "--modes", "kv,deep"])
