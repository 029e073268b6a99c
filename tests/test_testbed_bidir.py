"""The bidirectional twin of the testbed (issue 39 part 2): the shipped folder, and its trainer's
objective (experiments/testbed/bidirectional.py) on a tiny model."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.testbed import bidirectional as tb
from maskahead_jax import tasks as T
from maskahead_jax.api import load_pretrained
from maskahead_jax.config import GenerationConfig, ModelConfig
from maskahead_jax.engine.generate import generate
from maskahead_jax.model import forward_logits
from maskahead_jax.model.init import init_params
from tiny import tiny_testbed_cfg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TWIN = os.path.join(ROOT, "maskahead_jax", "testbed_bidir")


# ----------------------------------------------------------------------------- the shipped twin
def test_shipped_twin_config_is_bidirectional_with_shifted_logits():
    with open(os.path.join(TWIN, "config.json")) as f:
        hf = json.load(f)
    assert hf["family"] == "dream" and hf["attention"] == "bidirectional" and hf["logits_shift"] is True
    cfg = load_pretrained(TWIN).config
    assert cfg.attention == "bidirectional" and cfg.logits_shift
    assert (cfg.mask_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (T.MASK_ID, (T.EOS_ID,), T.PAD_ID)
    assert cfg.block_size == 32 and cfg.commit_rule == "dynamic" and cfg.threshold == 0.95
    size = sum(os.path.getsize(os.path.join(TWIN, f)) for f in os.listdir(TWIN))
    assert size <= 25 * 2 ** 20
    with open(os.path.join(TWIN, "tokenizer.json"), "rb") as a, open(T.TOKENIZER_PATH, "rb") as b:
        assert a.read() == b.read()


def test_shipped_twin_answers_a_passkey_with_the_dense_cache():
    model = load_pretrained(TWIN)
    tok = T.get_tokenizer()
    ex = T.generate("passkey", 256, 0.5, 3, tok)
    prompt = [T.BOS_ID] + tok.encode(ex.prompt, add_special_tokens=False).ids
    out = generate(model, [prompt], GenerationConfig(max_new_tokens=16))
    text = tok.decode(out.tokens[0])
    assert ex.score(text) == 1.0, (text, ex.answer)
    assert T.EOS_ID not in out.tokens[0] and out.stats["nfe"][0] >= 1


# ----------------------------------------------------------------------------- objective
def tiny_cfg(**kw) -> ModelConfig:
    return tiny_testbed_cfg(**kw)


def test_noise_semi_ar_rows_are_clean_before_masked_after_and_mask_the_current_block():
    rng = np.random.default_rng(0)
    m, cur = tb.noise_response(rng, 400, 160, semi_ar=0.7)
    blk = np.arange(160) // 32
    sar = cur >= 0
    assert 0.6 < sar.mean() < 0.8
    for row, c in zip(m[sar], cur[sar]):
        assert not row[blk < c].any() and row[blk > c].all() and row[blk == c].any()
    assert m.any(1).all()
    # uniform rows: ratio t ~ U(0, 1) over the whole response, so about half of it masked on average
    assert 0.4 < m[~sar].mean() < 0.6
    # one block: every row has a mask in it
    m1, _ = tb.noise_response(rng, 50, 32, semi_ar=1.0)
    assert m1.any(1).all()


def test_batch_layout_prompt_padding_response_and_weights():
    tok = T.get_tokenizer()
    shape = tb.Shape(256, 32, 3)
    b = tb.make_batch(5, 1, shape, tok, answer_weight=3.0, pad_weight=0.5)
    assert b.prompt.shape == (3, shape.width) and b.x0.shape == (3, 32)
    again = tb.make_batch(5, 1, shape, tok, answer_weight=3.0, pad_weight=0.5)
    assert all(np.array_equal(x, y) for x, y in zip(b, again))  # a pure function of (seed, step)
    for i in range(3):
        n = b.plen[i]
        assert b.prompt[i, 0] == T.BOS_ID and (b.prompt[i, n:] == T.MASK_ID).all()
        na = int((b.w[i] == 3.0).sum())
        assert na >= 1 and (b.x0[i, na:] == T.EOS_ID).all() and T.EOS_ID not in b.x0[i, :na]
        assert b.w[i, na] == 1.0 and (b.w[i, na + 1:] == 0.5).all()
    assert np.array_equal(b.xt, np.where(b.masked, T.MASK_ID, b.x0)) and b.masked.any(1).all()
    lb = tb.make_batch(0, 1, tb.Shape(512, 160, 1), tok)
    assert (lb.w[0] == 3.0).sum() > 32  # the long answer spans blocks


def _ragged(cfg, key, b=2, pw=48, g=32):
    prompt = np.array(jax.random.randint(key, (b, pw), 5, cfg.vocab_size), np.int32)
    plen = np.array([pw, pw - 11][:b], np.int32)
    for i in range(b):
        prompt[i, plen[i]:] = cfg.mask_token_id
    xt = np.array(jax.random.randint(jax.random.fold_in(key, 1), (b, g), 5, cfg.vocab_size), np.int32)
    xt[:, ::3] = cfg.mask_token_id
    return prompt, plen, xt


def test_twin_logits_are_shifted_full_attention_logits():
    """With pass 1 reading the response (refresh), the engine's two passes equal one full forward
    of [prompt | response]: response token j is predicted by the output at plen + j - 1."""
    cfg = tiny_cfg()
    params = init_params(cfg, jax.random.PRNGKey(0), jnp.float32)
    prompt, plen, xt = _ragged(cfg, jax.random.PRNGKey(1))
    refresh = np.ones(2, bool)
    for cache_grad in (False, True):
        got = tb.twin_logits(params, cfg, jnp.asarray(prompt), jnp.asarray(plen), jnp.asarray(xt),
                             jnp.asarray(refresh), cache_grad)
        for i in range(2):
            n = plen[i]
            toks = np.concatenate([prompt[i, :n], xt[i]])[None]
            ref = forward_logits(params, cfg, jnp.asarray(toks))[0]  # full attention, no padding
            np.testing.assert_allclose(got[i], ref[n - 1:n - 1 + xt.shape[1]], atol=2e-4, rtol=2e-4)


def test_twin_logits_first_step_match_the_engine_cache():
    """Pass 1 with an all-[MASK] response (no refresh): the prompt K/V are computed against the
    masks, as the engine's cache is; the response then reads that cache. Equal to a direct two-step
    computation, and the same in both gradient modes."""
    cfg = tiny_cfg()
    params = init_params(cfg, jax.random.PRNGKey(2), jnp.float32)
    prompt, plen, xt = _ragged(cfg, jax.random.PRNGKey(3))
    a = tb.twin_logits(params, cfg, prompt, plen, xt, np.zeros(2, bool), False)
    b = tb.twin_logits(params, cfg, prompt, plen, xt, np.zeros(2, bool), True)
    np.testing.assert_allclose(a, b, atol=2e-4, rtol=2e-4)
    allmask = np.full_like(xt, cfg.mask_token_id)
    c = tb.twin_logits(params, cfg, prompt, plen, allmask, np.zeros(2, bool), False)
    d = tb.twin_logits(params, cfg, prompt, plen, allmask, np.ones(2, bool), False)
    np.testing.assert_allclose(c, d, atol=2e-4, rtol=2e-4)  # all-mask: refresh changes nothing
    assert not np.allclose(a, tb.twin_logits(params, cfg, prompt, plen, xt, np.ones(2, bool), False), atol=1e-3)


def test_loss_reads_only_masked_response_positions():
    cfg = tiny_cfg()
    params = init_params(cfg, jax.random.PRNGKey(4), jnp.float32)
    prompt, plen, xt = _ragged(cfg, jax.random.PRNGKey(5))
    masked = xt == cfg.mask_token_id
    x0 = np.where(masked, 7, xt).astype(np.int32)
    w = np.ones(x0.shape, np.float32)
    batch = lambda x, ww: (prompt, plen, x, xt, masked, ww, np.zeros(2, bool))
    base, _ = tb.twin_loss(params, cfg, batch(x0, w))
    x_un = x0.copy()
    x_un[~masked] = 9  # a different clean token where nothing is masked: the loss cannot see it
    assert float(tb.twin_loss(params, cfg, batch(x_un, w))[0]) == pytest.approx(float(base), rel=1e-6)
    x_m = x0.copy()
    x_m[masked] = 9
    assert abs(float(tb.twin_loss(params, cfg, batch(x_m, w))[0]) - float(base)) > 1e-4
    w2 = w.copy()
    w2[~masked] = 100.0  # weights outside the masks do not count either
    assert float(tb.twin_loss(params, cfg, batch(x0, w2))[0]) == pytest.approx(float(base), rel=1e-6)


def test_a_few_steps_reduce_the_loss_and_the_run_resumes(tmp_path, capsys):
    from experiments.train_testbed import export_hf

    cfg = tiny_cfg(family="sdar", attention="block_causal")
    export_hf(init_params(cfg, jax.random.PRNGKey(6), jnp.float32), cfg, str(tmp_path / "init"))
    tok = T.get_tokenizer()
    twin = tb.twin_config(cfg)
    params = tb.load_init(str(tmp_path / "init"), init_params(cfg, jax.random.PRNGKey(0), jnp.float32))
    opt, _ = tb.make_optimizer(3e-3, 1, 100)
    state = opt.init(params)
    step = tb.make_train_step(twin, opt)
    batch = tuple(map(jnp.asarray, tb.make_batch(0, 0, tb.Shape(128, 32, 2), tok)))
    losses = []
    for _ in range(8):
        params, state, loss, _ = step(params, state, batch)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.1, losses

    run = str(tmp_path / "run")
    common = ["--init-from", str(tmp_path / "init"), "--run-dir", run, "--shapes", "128:32:2",
              "--eval-minutes", "0", "--log-every", "1", "--warmup", "1"]
    tb.main(common + ["--steps", "3"])
    with np.load(os.path.join(run, tb.CKPT)) as z:
        assert int(z["step"]) == 3
    first = capsys.readouterr().out
    tb.main(common + ["--steps", "5"])
    out = capsys.readouterr().out
    assert "resumed" in out and "at step 3" in out and "step 4 loss" in out and "step 1 loss" not in out
    assert "step 1 loss" in first
    with np.load(os.path.join(run, tb.CKPT)) as z:
        assert int(z["step"]) == 5
    exported = load_pretrained(os.path.join(run, "export"))
    assert exported.config.attention == "bidirectional" and exported.config.logits_shift


# ----------------------------------------------------------------------------- long context (issue 53)
def test_twin_positions_default_layout_and_skip_wise_ids():
    """Default: prompt 0..plen-1, padding at the last prompt id, the response right after it.
    Skip-wise: sorted unique prompt ids cut on block boundaries, < target - G, the question's tail
    contiguous with the response, which follows the last prompt id; a pure function of the rng."""
    d = tb.twin_positions(40, 64, 32)
    assert list(d[:40]) == list(range(40)) and (d[40:64] == 39).all() and list(d[64:]) == list(range(40, 72))
    pose = tb.Pose(target=4096, chunks=3, tail_blocks=4)
    skipped = 0
    for seed in range(30):
        p = tb.twin_positions(300, 320, 32, np.random.default_rng(seed), pose)
        assert np.array_equal(p, tb.twin_positions(300, 320, 32, np.random.default_rng(seed), pose))
        ids, pad, resp = p[:300], p[300:320], p[320:]
        assert (np.diff(ids) > 0).all() and ids[0] == 0 and (pad == ids[-1]).all()
        assert list(resp) == list(range(ids[-1] + 1, ids[-1] + 33)) and resp[-1] < 4096
        jumps = np.nonzero(np.diff(ids) > 1)[0] + 1
        assert all(j % 32 == 0 and ids[j] % 32 == 0 for j in jumps) and len(jumps) <= 2
        assert ids[-1] - ids[-32] == 31  # the last block before the response is contiguous with it
        skipped += ids[-1] > 1000
    assert skipped >= 15  # the extent is log-uniform in [L, target]: most rows reach far


def test_batch_with_pose_off_is_the_old_batch_and_on_changes_only_positions():
    tok = T.get_tokenizer()
    shape = tb.Shape(256, 32, 3)
    off = tb.make_batch(4, 2, shape, tok)
    assert all(np.array_equal(x, y) for x, y in zip(off, tb.make_batch(4, 2, shape, tok, pose=tb.Pose())))
    for i in range(3):
        assert np.array_equal(off.pos[i], tb.twin_positions(int(off.plen[i]), shape.width, 32))
    on = tb.make_batch(4, 2, shape, tok, pose=tb.Pose(target=8192, tail_blocks=4))
    assert all(np.array_equal(x, y) for x, y in zip(off[:-1], on[:-1]))
    assert (on.pos.max(1) < 8192).all() and (on.pos.max(1) > off.pos.max(1)).any()
    short = tb.make_batch(4, 2, shape, tok, pose=tb.Pose(target=8192, min_len=512))
    assert np.array_equal(short.pos, off.pos)  # shapes under --pose-min-len keep arange


def test_twin_logits_at_skip_wise_positions_are_a_full_forward_there():
    """The two passes at Batch.pos equal one full forward of [prompt | response] at those ids; at
    the default layout they equal the call without pos."""
    cfg = tiny_cfg()
    params = init_params(cfg, jax.random.PRNGKey(7), jnp.float32)
    prompt, plen, xt = _ragged(cfg, jax.random.PRNGKey(8))
    pw, g = prompt.shape[1], xt.shape[1]
    refresh = jnp.ones(2, bool)
    dflt = np.stack([tb.twin_positions(int(n), pw, g) for n in plen])
    np.testing.assert_allclose(tb.twin_logits(params, cfg, prompt, plen, xt, refresh, False, jnp.asarray(dflt)),
                               tb.twin_logits(params, cfg, prompt, plen, xt, refresh), atol=1e-5, rtol=1e-5)
    pos = np.stack([tb.twin_positions(int(n), pw, g, np.random.default_rng(i), tb.Pose(target=2048, tail_blocks=1))
                    for i, n in enumerate(plen)])
    assert pos.max() > pw + g
    for cache_grad in (False, True):
        got = tb.twin_logits(params, cfg, prompt, plen, xt, refresh, cache_grad, jnp.asarray(pos))
        for i in range(2):
            n = plen[i]
            toks = np.concatenate([prompt[i, :n], xt[i]])[None]
            at = np.concatenate([pos[i, :n], pos[i, pw:]])[None]
            ref = forward_logits(params, cfg, jnp.asarray(toks), jnp.asarray(at))[0]
            np.testing.assert_allclose(got[i], ref[n - 1:n - 1 + g], atol=2e-4, rtol=2e-4)


def test_twin_logits_under_dynamic_yarn_give_the_recomputed_position_the_whole_rows_factor():
    """dynamic_yarn reads each row's largest id: the one-token recompute of the last prompt position
    (cache_grad False) must get the factor of the whole [prompt | response] row, as pass 1 (the
    exact path, cache_grad True) and the engine's fixed run length give it."""
    from maskahead_jax.model.rope import RopeScaling

    cfg = tiny_cfg(rope_scaling=RopeScaling("dynamic_yarn", factor=8.0, original_max_position_embeddings=16))
    params = init_params(cfg, jax.random.PRNGKey(9), jnp.float32)
    prompt, plen, xt = _ragged(cfg, jax.random.PRNGKey(10))  # rows of 48 + 32 and 37 + 32: factor 5, 4.3
    for refresh in (np.zeros(2, bool), np.ones(2, bool)):
        a = tb.twin_logits(params, cfg, prompt, plen, xt, refresh, False)
        b = tb.twin_logits(params, cfg, prompt, plen, xt, refresh, True)
        np.testing.assert_allclose(a, b, atol=2e-4, rtol=2e-4)


def test_pose_flags_are_checked_against_the_model_and_shapes():
    cfg = tiny_cfg(max_position_embeddings=8192)
    shapes = tb.parse_shapes("1024:32:2")
    ok = tb.build_parser().parse_args(["--pose-target", "4096", "--pose-tail-blocks", "8"])
    assert tb.pose_options(ok, cfg, shapes) == tb.Pose(4096, 1.0, 0, 3, 8)
    for bad in (["--pose-target", "4010"], ["--pose-target", "16384"], ["--pose-target", "1024"],
                ["--pose-target", "4096", "--pose-chunks", "1"], ["--pose-target", "4096", "--pose-prob", "0"]):
        with pytest.raises(SystemExit):
            tb.pose_options(tb.build_parser().parse_args(bad), cfg, shapes)


def test_twin_long_cpu_script_command_parses(tmp_path):
    """experiments/testbed/train_twin_long_cpu.sh (DRY_RUN=1 prints the command) runs
    bidirectional.py with flags that parse and pass its checks against the export it starts from:
    skip-wise positions to 32768 under that export's Dynamic-YaRN, the probe at 8192."""
    import subprocess

    script = os.path.join(ROOT, "experiments", "testbed", "train_twin_long_cpu.sh")
    env = dict(os.environ, DRY_RUN="1", TWIN_LONG_DIR=str(tmp_path))
    argv = subprocess.run(["bash", script], env=env, capture_output=True, text=True, check=True).stdout.splitlines()
    assert argv[:3] == ["nice", "-n", "19"] and argv[4:6] == ["-m", "experiments.testbed.bidirectional"]
    args = tb.build_parser().parse_args(argv[6:])
    assert args.run_dir == str(tmp_path / "run") and args.eval_length == 8192
    base = load_pretrained(os.path.join(ROOT, args.init_from))
    cfg = tb.twin_config(base.config)
    assert cfg.rope_scaling.type == "dynamic_yarn" and cfg.attention == "bidirectional"
    assert tb.pose_options(args, cfg, tb.parse_shapes(args.shapes)).target == 32768
