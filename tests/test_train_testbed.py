"""The testbed training package (experiments/testbed/) and its entry point
(experiments/train_testbed.py): data, noise, the two-copy mask, the gated curriculum, one
optimisation step, model surgery, the held-out probe and the exporter read back through the
library's converter."""
import argparse
import json
import os
import random
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import train_testbed as tt
from experiments.testbed import clock, config, data, export, objective, prefetch, surgery
from maskahead_jax import load_pretrained
from maskahead_jax import tasks as T
from maskahead_jax.model.decoder import forward_hidden, forward_logits
from maskahead_jax.model.init import init_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tok():
    return T.build_tokenizer()


def _args(**kw):
    a = dict(d_model=32, heads=2, kv_heads=1, ffn=64, layers=2, rope_theta=1e4, answer_weight=3.0,
             suffix_prob=0.5, copy_prob=0.25, layout="qwen3")
    a.update(kw)
    return argparse.Namespace(**a)


@pytest.mark.parametrize("dense,copy", [(0.0, 0.0), (1.0, 0.0), (0.0, 1.0)])
def test_sequences_exact_length_and_deterministic(tok, dense, copy):
    for L in (64, 256):
        a = [data.train_sequence(random.Random(3), L, tok, 3.0, dense, copy) for _ in range(2)]
        (x, w), (x2, w2) = a
        assert x.shape == w.shape == (L,) and x.dtype == np.int32
        np.testing.assert_array_equal(x, x2)
        assert x[0] == T.BOS_ID and (w > 0).all() and (w == 3.0).any()
        assert T.MASK_ID not in x and x.max() < tok.get_vocab_size()


def test_copy_sequence_repeats_its_segment(tok):
    x, w = data.copy_sequence(random.Random(0), 256, tok, 3.0)
    again = tok.token_to_id("again")
    starts = [i + 2 for i in np.nonzero(x == again)[0] if i + 2 < 200]
    seg = x[1:np.nonzero(x == tok.token_to_id("."))[0][0]]
    assert len(starts) >= 2
    for s in starts:  # every repeat after "again :" is the opening segment, weighted as an answer
        np.testing.assert_array_equal(x[s:s + len(seg)], seg)
        assert (w[s:s + len(seg)] == 3.0).all()


def test_make_batch_noise(tok):
    args = _args(suffix_prob=1.0)
    xt, x0, masked, w = data.make_batch(5, 0, 4, 128, tok, args, dense=0.5)
    assert xt.shape == x0.shape == masked.shape == w.shape == (4, 128)
    np.testing.assert_array_equal(xt == T.MASK_ID, masked)
    np.testing.assert_array_equal(np.where(masked, x0, xt), x0)
    # suffix pattern: inside each 32-token block everything after the cut is masked
    blocks = masked.reshape(4, 4, 32)
    assert (np.diff(blocks.astype(int), axis=-1) >= 0).all()


def test_prefetched_batches_equal_inline_batches(tok):
    """Worker processes build exactly the batch make_batch builds inline: through a stage that
    alternates two shapes step by step (each queued step keeps its own shape, none rebuilt) and
    across a stage change (the queued batches of the old schedule dropped)."""
    args = _args(seed=3)
    alternating = lambda s: [(2, 64, 0.5), (3, 128, 0.2)][s % 2]  # noqa: E731
    single = lambda s: (1, 96, 0.3)  # noqa: E731
    pf = prefetch.BatchPrefetcher(args, workers=1, ahead=3)
    try:
        for step in range(6):
            schedule = alternating if step < 4 else single
            got = pf.get(step, schedule)
            B, L, dense = schedule(step)
            want = data.make_batch(step, args.seed, B, L, tok, args, dense)
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w)
            assert [(s, shape) for s, shape, _ in pf.queue] == [(s, schedule(s)) for s in range(step + 1, step + 3)]
    finally:
        pf.close()


def test_mqar_sequence_answers_are_the_recalled_values(tok):
    """Every weighted query value is the value its key had in the recall list."""
    for seed in range(3):
        x, w = data.mqar_sequence(random.Random(seed), 160, tok, 3.0)
        assert x.shape == (160,) and w.shape == (160,)
        words = [tok.id_to_token(int(t)) for t in x]
        q = words.index("answer")
        table = {words[i]: words[i + 1] for i in range(3, q - 1, 3)}  # "recall : k v , k v , ..."
        answers = [i for i in range(len(x)) if w[i] == 3.0]
        assert answers and all(i > q for i in answers)
        for i in answers:
            assert table[words[i - 1]] == words[i]


def test_mqar_two_word_keys_with_a_link(tok):
    """key_words=2, link="is": "adj noun is v" facts; each answer follows "is" and its two-word key."""
    x, w = data.mqar_sequence(random.Random(1), 128, tok, 3.0, (2, 4), key_words=2, link="is")
    words = [tok.id_to_token(int(t)) for t in x]
    q = words.index("answer")
    table = {(words[i], words[i + 1]): words[i + 3] for i in range(3, q - 1, 5)}
    answers = [i for i in range(len(x)) if w[i] == 3.0]
    assert 2 <= len(table) <= 4 and answers
    for i in answers:
        assert words[i - 1] == "is" and table[(words[i - 3], words[i - 2])] == words[i]


def test_mqar_pairs_option(tok):
    """--mqar-pairs LO:HI bounds the recall list's length; bad ranges are refused by name."""
    for seed in range(5):
        x, _ = data.mqar_sequence(random.Random(seed), 64, tok, 3.0, pairs=data.parse_pairs("2:4"))
        words = [tok.id_to_token(int(t)) for t in x]
        q = words.index("answer")  # [BOS] recall : (k v ,) x n . answer
        assert (q - 4) % 3 == 0 and 2 <= (q - 4) // 3 <= 4
    assert data.parse_pairs(None) is None
    for bad in ("4:2", "1:3", "two"):
        with pytest.raises(SystemExit, match="--mqar-pairs"):
            data.parse_pairs(bad)
    a = _args(seed=0, copy_prob=0.0, mqar_prob=1.0, mqar_pairs="2:3")
    x0 = data.make_batch(0, 0, 4, 64, tok, a)[1]
    for row in x0:
        words = [tok.id_to_token(int(t)) for t in row]
        assert words[1] == "recall" and words.index("answer") in (4 + 3 * 2, 4 + 3 * 3)


def test_answer_mask_prob_masks_exactly_the_answers(tok):
    a = _args(seed=0, copy_prob=0.0, mqar_prob=1.0, answer_mask_prob=1.0)
    xt, x0, masked, w = data.make_batch(3, 0, 4, 64, tok, a)
    np.testing.assert_array_equal(masked, w == 3.0)
    np.testing.assert_array_equal(xt == T.MASK_ID, masked)
    mixed = data.make_batch(3, 0, 64, 64, tok, _args(seed=0, copy_prob=0.0, mqar_prob=1.0, answer_mask_prob=0.5))
    rows = [(m == (ww == 3.0)).all() for m, ww in zip(mixed[2], mixed[3])]
    assert 0 < sum(rows) < 64  # some rows answer-only, the others with the usual random noise


def test_answer_mask_max_len_spares_long_answers(tok):
    """With --answer-mask-max-len 32, answer-only rows are drawn as before but a row whose answer
    is longer than a block (the long answer: ~126 tokens) keeps the usual noise; short-answer rows
    are unchanged."""
    assert data.longest_run(np.array([[1, 1, 0, 1, 1, 1, 0], [0] * 7], bool)).tolist() == [3, 0]
    for weights, long in (("0,0,0,0,1", True), ("0.3,0.3,0.2,0.2,0", False)):
        a = _args(seed=0, copy_prob=0.0, answer_mask_prob=1.0, task_weights=weights)
        b = _args(seed=0, copy_prob=0.0, answer_mask_prob=1.0, task_weights=weights, answer_mask_max_len=32)
        xt, x0, masked, w = data.make_batch(1, 0, 4, 512, tok, a)
        xt2, x02, masked2, w2 = data.make_batch(1, 0, 4, 512, tok, b)
        np.testing.assert_array_equal(x0, x02)
        np.testing.assert_array_equal(masked, w == 3.0)  # without the limit: answer-only rows
        if long:
            assert (data.longest_run(w == 3.0) > 32).all()
            assert not any((m == (ww == 3.0)).all() for m, ww in zip(masked2, w2))
        else:
            np.testing.assert_array_equal(masked2, masked)
    with pytest.raises(SystemExit, match="--answer-mask-max-len -1"):
        tt.check_data_flags(_args(answer_mask_max_len=-1, smoke=True, smoke_stage="0:128:16:0.5"))


def test_task_weights_option(tok):
    """--task-weights with the default values reproduces the default batch; bad weights are refused;
    a multikey-only mix yields multikey prompts."""
    base = data.make_batch(2, 0, 3, 128, tok, _args(seed=0, copy_prob=0.0), dense=0.0)
    same = data.make_batch(2, 0, 3, 128, tok, _args(seed=0, copy_prob=0.0,
                                                   task_weights=",".join(map(str, data.TASK_WEIGHTS))), dense=0.0)
    for a, b in zip(base, same):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(SystemExit, match="bad --task-weights"):
        data.make_batch(0, 0, 1, 64, tok, _args(seed=0, task_weights="1,2"), dense=0.0)
    x0 = data.make_batch(1, 0, 4, 128, tok, _args(seed=0, copy_prob=0.0, task_weights="0,1,0,0,0"), dense=0.0)[1]
    assert all("special magic number" in tok.decode(list(row)) for row in x0)


@pytest.mark.parametrize("shift", [False, True])
def test_two_copy_logits_match_per_block_forwards(tok, shift):
    """Block b of the noisy copy is predicted as generation would predict it: a block-causal forward
    of [clean blocks < b, noisy block b]; shifted logits read position p - 1, and a block's first
    token the clean previous block's last position."""
    a = _args(logits_shift=shift)
    cfg = config.make_config(a, tok.get_vocab_size())
    params = init_params(cfg, jax.random.PRNGKey(1))
    xt, x0, _, _ = data.make_batch(0, 0, 2, 96, tok, _args(seed=0))
    got = np.asarray(objective.two_copy_logits(params, cfg, xt, x0))
    bs = data.BLOCK
    for b in range(96 // bs):
        seq = np.concatenate([x0[:, :b * bs], xt[:, b * bs:(b + 1) * bs]], axis=1)
        ref = np.asarray(forward_logits(params, cfg, seq, attention="block_causal"))
        lo = b * bs
        if not shift:
            np.testing.assert_allclose(got[:, lo:lo + bs], ref[:, lo:], rtol=2e-4, atol=2e-4)
            continue
        np.testing.assert_allclose(got[:, lo + 1:lo + bs], ref[:, lo:lo + bs - 1], rtol=2e-4, atol=2e-4)
        if b:  # the first token: the clean prefix's last position
            clean = np.asarray(forward_logits(params, cfg, x0[:, :lo], attention="block_causal"))
            np.testing.assert_allclose(got[:, lo], clean[:, -1], rtol=2e-4, atol=2e-4)


def test_two_copy_mask():
    L, bs = 96, data.BLOCK
    m = objective.two_copy_mask(L)
    for q in (0, 40, 70):
        qb = q // bs
        # noisy query: its own noisy block and the clean blocks before it
        expect = np.zeros(2 * L, bool)
        expect[qb * bs:(qb + 1) * bs] = True
        expect[L:L + qb * bs] = True
        np.testing.assert_array_equal(m[q], expect)
        # clean query: clean blocks up to its own (block-causal)
        expect = np.zeros(2 * L, bool)
        expect[L:L + (qb + 1) * bs] = True
        np.testing.assert_array_equal(m[L + q], expect)


def test_alternating_stage_cycles_its_lengths():
    st = clock.parse_stages("0:1024:4:0.3,0.8:512|2560:8|2:0.3")
    assert st[0] == (0.0, ((1024, 4),), 0.3)
    assert [clock.stage_shape(st[1], s) for s in (10, 11, 12)] == [(512, 8), (2560, 2), (512, 8)]
    with pytest.raises(SystemExit, match="2 lengths but 1 batch"):
        clock.parse_stages("0:512|1024:8")


def test_curriculum_is_gated():
    st = clock.parse_stages("0:128:32:0.8,0.3:256:16,0.6:512:8:0.4")
    assert st[1] == (0.3, ((256, 16),), 0.0)
    assert clock.curriculum(0.31, st, 0, heldout=0.0, gate=0.3) == 0  # no retrieval yet: stay
    assert clock.curriculum(0.31, st, 0, heldout=0.5, gate=0.3) == 1  # retrieval: grow
    assert clock.curriculum(0.46, st, 0, heldout=0.0, gate=0.3) == 1  # slack: grow anyway
    assert clock.curriculum(0.99, st, 0, heldout=1.0, gate=0.3) == 2
    assert clock.curriculum(0.99, st, 2, heldout=0.0, gate=0.3) == 2


def test_train_step_lowers_loss_on_a_fixed_batch(tok):
    args = _args()
    cfg = config.make_config(args, 1536)
    params = init_params(cfg, jax.random.PRNGKey(0))
    opt = optax.inject_hyperparams(lambda learning_rate: optax.adamw(learning_rate))(learning_rate=3e-3)
    state = opt.init(params)
    step = objective.make_train_step(cfg, opt, 64)
    batch = data.make_batch(0, 0, 4, 64, tok, args, dense=0.5)
    losses = []
    for _ in range(8):
        params, state, loss, _ = step(params, state, *batch)
        losses.append(float(loss))
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


@pytest.mark.parametrize("tied,layout,shift,rope", [(True, "qwen3", False, None), (False, "qwen3", True, None),
                                                    (True, "qwen2", True, None), (True, "qwen3", True, "yarn:4:64"),
                                                    (True, "qwen3", True, "dynamic_yarn:16:64")])
def test_export_reads_back_through_converter(tmp_path, tied, layout, shift, rope):
    """Every layout make_config builds (SDAR's qwen3, Fast-dLLM v2's qwen2), and a --rope-scaling
    run's YaRN (trained and exported with it; the positions stay --max-positions), comes back
    from load_pretrained as the same config and (to bfloat16 precision) the same function."""
    args = _args(untied=not tied, layout=layout, logits_shift=shift, rope_scaling=rope, max_positions=1024)
    cfg = config.make_config(args, 1536)
    if rope:
        s = cfg.rope_scaling
        assert (s.type, s.factor, s.original_max_position_embeddings) == tuple(
            (t, float(f), int(o)) for t, f, o in [rope.split(":")])[0]
        assert cfg.max_position_embeddings == 1024
    params = init_params(cfg, jax.random.PRNGKey(1))
    out = export.export_hf(params, cfg, str(tmp_path))
    model = load_pretrained(out)
    assert model.config == cfg
    if rope and rope.startswith("dynamic"):  # our key; transformers' rope_scaling stays plain
        hf = json.load(open(os.path.join(out, "config.json")))
        assert "rope_scaling" not in hf and hf["maskahead_rope_scaling"]["rope_type"] == "dynamic_yarn"
    toks = np.asarray([[T.BOS_ID] + list(range(10, 40)) * 3], np.int32)  # 91 positions: past 64
    want = forward_logits(params, cfg, toks)
    got = forward_logits(model.params, model.config, toks)
    # exported in bfloat16: compare the predictions, with a loose bound on the logits
    assert np.abs(np.asarray(got, np.float32) - np.asarray(want)).max() < 0.05


def test_shipped_testbed_reexports_byte_identical(tmp_path):
    """Loading the shipped export and exporting it again writes the very same three files, byte
    for byte (weights through the converters' key tables, config.json, tokenizer)."""
    shipped = os.path.join(ROOT, "maskahead_jax", "testbed")
    model = load_pretrained(shipped, dtype="float32")
    out = export.export_hf(model.params, model.config, str(tmp_path / "again"))
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        with open(os.path.join(shipped, name), "rb") as a, open(os.path.join(out, name), "rb") as b:
            assert a.read() == b.read(), name


def test_entry_point_reexports_the_package():
    """experiments.train_testbed keeps the names other scripts imported from it, as the
    package's own objects (one implementation)."""
    for mod in (clock, config, data, export, objective, prefetch, surgery):
        for name in getattr(mod, "__all__", None) or [n for n in vars(mod) if not n.startswith("_")]:
            obj = getattr(mod, name)
            if getattr(obj, "__module__", None) == mod.__name__ and hasattr(tt, name):
                assert getattr(tt, name) is obj, name
    for name in ("make_batch", "train_sequence", "mqar_sequence", "copy_sequence", "load_init",
                 "make_config", "export_hf", "make_train_step", "two_copy_logits", "BatchPrefetcher",
                 "ActiveClock", "parse_stages", "curriculum", "grow_layers", "grow_heads", "BLOCK",
                 "data_options", "check_data_flags", "heldout_eval", "main"):
        assert hasattr(tt, name), name
    assert not hasattr(tt, "greedy_answers") and not hasattr(tt, "make_decoder")  # no decoder of its own


def test_learning_rate_schedule():
    """Linear warm-up over `warmup` steps, then a cosine from the peak to 10% over the budget;
    --constant-lr keeps the peak after the warm-up."""
    assert clock.learning_rate(0, 0.0, 1e-3, 10) == pytest.approx(1e-4)
    assert clock.learning_rate(9, 0.0, 1e-3, 10) == pytest.approx(1e-3)
    assert clock.learning_rate(500, 0.5, 1e-3, 10) == pytest.approx(0.55e-3)
    assert clock.learning_rate(900, 1.0, 1e-3, 10) == pytest.approx(1e-4)
    assert clock.learning_rate(900, 0.7, 1e-3, 10, constant=True) == pytest.approx(1e-3)


def _documented_commands():
    """Every train_testbed.py command written in the model card and the training log, as argv
    (gpu_train_testbed.sh commands with the flags the script adds); continuation lines joined,
    comments dropped, commands with a [placeholder] skipped."""
    import re
    import shlex

    out = []
    for rel in ("maskahead_jax/testbed/README.md", "docs/testbed_history.md"):
        with open(os.path.join(ROOT, rel)) as f:
            text = re.sub(r"\\\n\s*", " ", f.read())
        for line in text.splitlines():
            line = line.split(" # ")[0].strip()
            m = re.search(r"(?:python3? experiments/train_testbed\.py|bash experiments/gpu_train_testbed\.sh)(.*)$", line)
            if not m or "[" in m.group(1) or "<" in m.group(1):
                continue
            argv = shlex.split(m.group(1).split("`")[0])
            if "gpu_train_testbed" in line:
                argv += ["--workers", "2", "--run-dir", "/tmp/tb", "--out", "/tmp/out/export"]
            out.append((rel, argv))
    return out


def test_documented_commands_still_parse():
    """The card's and the training log's commands (every shipped stage's) parse with today's
    command line and pass the startup checks."""
    cmds = _documented_commands()
    assert len(cmds) >= 20
    assert any("--grow-heads" in argv for _, argv in cmds)  # the card's last step (stage 29)
    for rel, argv in cmds:
        args = tt.build_parser().parse_args(argv)
        tt.check_data_flags(args)


def test_heldout_eval_decodes_with_the_library(tok):
    """The held-out probe decodes through maskahead_jax.generate: the shipped testbed retrieves
    its pass keys, and the answers are generate's own on the same prompts."""
    from experiments.testbed import heldout
    from maskahead_jax import GenerationConfig, generate

    model = load_pretrained(os.path.join(ROOT, "maskahead_jax", "testbed"), dtype="float32")
    res = heldout.heldout_eval(model.params, model.config, tok, 192, n=3, tasks=("passkey",))
    assert res == {"passkey": 1.0, "passkey_from_context": 1.0}
    exs = heldout.heldout_examples("passkey", 192, 3, tok)
    outs = generate(model, [tok.encode(e.prompt).ids for e in exs],
                    GenerationConfig(max_new_tokens=heldout.MAX_NEW)).tokens
    assert all(e.score(tok.decode(o)) == 1.0 for e, o in zip(exs, outs))


def test_recall_control_runs_and_refuses_a_leaking_layout(capsys, tmp_path):
    """experiments/recall_control.py: a few steps report an answer accuracy in [0, 1] and export
    weights the library loads; block-causal attention without masked answers (an answer readable
    by its own predictor) is refused."""
    from experiments import recall_control as rc

    acc = rc.main(["--max-steps", "3", "--report-every", "1", "--batch", "4", "--d-model", "32",
                   "--mask-answers", "--block", "32", "--save", str(tmp_path / "m")])
    assert 0.0 <= acc <= 1.0
    assert '"summary": true' in capsys.readouterr().out
    model = load_pretrained(str(tmp_path / "m"), dtype="float32")
    assert model.config.hidden_size == 32 and model.config.num_layers == 2
    assert 0.0 <= rc.main(["--data", "multikey", "--max-steps", "1", "--batch", "2", "--d-model", "32",
                           "--length", "128"]) <= 1.0
    assert 0.0 <= rc.main(["--data", "longanswer,docqa", "--max-steps", "1", "--batch", "2", "--d-model", "32",
                           "--length", "128"]) <= 1.0
    with pytest.raises(SystemExit, match="--mask-answers"):
        rc.main(["--block", "32"])
    with pytest.raises(SystemExit, match="unknown \\['nope'\\]"):
        rc.main(["--data", "multikey,nope"])


def _facts_and_answers(tok, x, w):
    """Decode a sentence-template recall sequence: {key: value} from its facts, and the answers."""
    words = [tok.id_to_token(int(t)) for t in x]
    table, answers = {}, []
    for i, t in enumerate(words):
        if i >= 3 and words[i - 1] == "is" and t.isdigit():
            key = (words[i - 3], words[i - 2])
            if w[i] == 3.0:
                answers.append((key, t))
            else:
                table.setdefault(key, t)
    return words, table, answers


def test_mqar_sentence_template_keeps_a_suffix_of_the_task_phrase(tok):
    """template="sentence": "[P] adj noun is v ." where P is the same suffix of "the special magic
    number for" in every fact and query of a sequence; every answer is its key's value, and over
    seeds every suffix length (none .. the whole phrase) occurs."""
    phrase = "the special magic number for".split()
    leads = set()
    for seed in range(40):
        x, w = data.mqar_sequence(random.Random(seed), 128, tok, 3.0, (2, 4), key_words=2, template="sentence")
        words, table, answers = _facts_and_answers(tok, x, w)
        assert 2 <= len(table) <= 4 and answers
        for key, v in answers:
            assert table[key] == v
        starts = [i for i in range(1, len(words) - 3) if words[i + 2] == "is" and words[i + 3].isdigit()]
        lead = tuple(words[1:starts[0]])  # the words between [BOS] and the first key
        assert lead == tuple(phrase[len(phrase) - len(lead):])
        for s in starts[1:]:
            if s - len(lead) > 0:
                assert tuple(words[s - len(lead):s]) == lead
        leads.add(len(lead))
    assert leads == set(range(len(phrase) + 1))


def test_mqar_question_template_is_the_multikey_question(tok):
    """template="question": facts are multi-key's sentences and each answer ends the task's own
    question, "what is the special magic number for K ? the special magic number for K is"."""
    x, w = data.mqar_sequence(random.Random(3), 256, tok, 3.0, key_words=2, template="question")
    words, table, answers = _facts_and_answers(tok, x, w)
    assert len(answers) >= 2 and 256 // 48 <= len(table) <= max(2, 256 // 24)
    text = " ".join(words)
    for key, v in answers:
        assert table[key] == v
        k = " ".join(key)
        assert f"what is the special magic number for {k} ? the special magic number for {k} is {v}" in text
    with pytest.raises(ValueError, match="unknown recall template"):
        data.mqar_sequence(random.Random(0), 64, tok, 3.0, template="poem")


def test_mqar_templates_option(tok):
    """--mqar-templates: batches draw from the named templates; an unknown one is refused by name."""
    assert data.parse_templates(None) == ("list",)
    assert data.parse_templates("list, question") == ("list", "question")
    with pytest.raises(SystemExit, match="--mqar-templates"):
        data.parse_templates("list,poem")
    a = _args(seed=0, copy_prob=0.0, mqar_prob=1.0, mqar_templates="question")
    x0 = data.make_batch(0, 0, 4, 128, tok, a)[1]
    for row in x0:
        words = [tok.id_to_token(int(t)) for t in row]
        assert words[1:6] == "the special magic number for".split() and "what" in words


def test_prompt_frac_sets_the_context_share(tok):
    """--prompt-frac LO:HI: an unpacked pass-key context (up to the first answer, the first token
    of weight answer_weight; repeated questions follow) takes that share of the sequence."""
    def first_answer(frac):
        r = random.Random(5)
        return [int(np.argmax(data.train_sequence(r, 512, tok, 3.0, 0.0, 0.0, (1, 0, 0, 0, 0),
                                                prompt_frac=frac)[1] == 3.0)) for _ in range(4)]
    assert all(0.85 * 512 <= n < 512 for n in first_answer((0.9, 0.9))), first_answer((0.9, 0.9))
    assert all(0.25 * 512 <= n <= 0.4 * 512 for n in first_answer((0.3, 0.3))), first_answer((0.3, 0.3))
    assert data.parse_prompt_frac("0.5:0.92") == (0.5, 0.92) and data.parse_prompt_frac(None) == data.PROMPT_FRAC


def test_grow_heads_keeps_the_function_and_trains_the_new_heads(tmp_path, tok):
    """--grow-heads: the wider model computes what the loaded one does (the new heads' rows of `wo`
    are zero and the old query heads keep their key/value heads) and one step moves those rows."""
    small = config.make_config(_args(), 1536)  # 2 query heads, 1 key-value head, head_dim 16
    params = init_params(small, jax.random.PRNGKey(3))
    wide_cfg = config.make_config(_args(heads=4, kv_heads=2, head_dim=16), 1536)
    assert wide_cfg.head_dim == small.head_dim == 16
    grown = surgery.grow_heads(params, 4, 2, jax.random.PRNGKey(4))
    assert jax.tree_util.tree_map(np.shape, grown) == jax.tree_util.tree_map(
        np.shape, init_params(wide_cfg, jax.random.PRNGKey(0)))
    np.testing.assert_array_equal(grown["layers"]["wq"][:, :, :2], params["layers"]["wq"])
    assert np.all(np.std(grown["layers"]["wk"][:, :, 1:]) > 0)  # new keys are not zero
    assert not np.any(grown["layers"]["wo"][:, 2:])
    toks = np.asarray([[T.BOS_ID] + list(range(10, 70))], np.int32)
    np.testing.assert_allclose(forward_logits(grown, wide_cfg, toks), forward_logits(params, small, toks),
                               rtol=1e-5, atol=1e-5)

    out = export.export_hf(params, small, str(tmp_path))  # through --init-from's loader
    loaded = surgery.load_init(out, init_params(wide_cfg, jax.random.PRNGKey(0)), (), widen_heads=True)
    exported = surgery.load_init(out, init_params(small, jax.random.PRNGKey(0)))  # (bfloat16 on disk)
    np.testing.assert_allclose(forward_logits(loaded, wide_cfg, toks), forward_logits(exported, small, toks),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(SystemExit, match="shapes"):
        surgery.load_init(out, init_params(wide_cfg, jax.random.PRNGKey(0)))  # 2 heads into 4, not grown
    with pytest.raises(SystemExit, match="cannot grow"):
        surgery.grow_heads(params, 3, 2, jax.random.PRNGKey(0))  # the grouping would change

    opt = optax.adamw(1e-3)
    step = objective.make_train_step(wide_cfg, opt, 64)
    batch = data.make_batch(0, 0, 2, 64, tok, _args(heads=4, kv_heads=2, head_dim=16))
    new, _, loss, _ = step(grown, opt.init(grown), *batch)
    assert np.isfinite(float(loss)) and np.any(new["layers"]["wo"][:, 2:])


@pytest.mark.parametrize("flag,value", [("--prompt-frac", "0.9:0.5"), ("--prompt-frac", "half"),
                                        ("--task-weights", "1,2"), ("--packed-weights", "a,b,c,d"),
                                        ("--mqar-pairs", "5:2"), ("--mqar-templates", "poem"),
                                        ("--edge-depths", "1.5"), ("--hard-keys", "1.5"), ("--stages", "0:512"),
                                        ("--grow-after", "1,x"), ("--grow-after", "1"),
                                        ("--grow-heads", None), ("--log-every", "0")])
def test_bad_data_flags_fail_at_startup(flag, value, monkeypatch):
    """A malformed data flag exits naming the flag before the model is built or anything written."""
    monkeypatch.setattr(tt, "init_params", lambda *a, **k: pytest.fail("built the model"))
    with pytest.raises(SystemExit, match=flag if flag != "--stages" else "bad stage"):
        tt.main([flag] + ([value] if value is not None else []) + ["--run-dir", "/nonexistent/run"])


def test_edge_depths_puts_needles_at_the_ends(tok, monkeypatch):
    """--edge-depths 1: every unpacked needle at depth 0 or 1, both used; 0 (the default) draws the
    very same batch as before the flag existed (no extra random draw)."""
    base = data.make_batch(4, 0, 6, 128, tok, _args(seed=0, copy_prob=0.0), dense=0.0)
    same = data.make_batch(4, 0, 6, 128, tok, _args(seed=0, copy_prob=0.0, edge_depths=0.0), dense=0.0)
    for a, b in zip(base, same):
        np.testing.assert_array_equal(a, b)
    depths, make = [], T.generate
    monkeypatch.setattr(T, "generate", lambda task, n, d, *a, **k: depths.append(d) or make(task, n, d, *a, **k))
    r = random.Random(1)
    for _ in range(12):
        data.train_sequence(r, 256, tok, 3.0, 0.0, 0.0, (1, 1, 1, 1, 0), edge_depths=1.0)
    assert len(depths) == 12 and set(depths) == {0.0, 1.0}


def test_hard_keys_share_a_word_with_the_asked_key(tok, monkeypatch):
    """--hard-keys 1: every multi-key context asks make_multikey for 1-4 keys sharing a word with
    the asked one; 0 (the default) draws the very same batch as before the flag existed."""
    base = data.make_batch(4, 0, 6, 128, tok, _args(seed=0, copy_prob=0.0), dense=0.0)
    same = data.make_batch(4, 0, 6, 128, tok, _args(seed=0, copy_prob=0.0, hard_keys=0.0), dense=0.0)
    for a, b in zip(base, same):
        np.testing.assert_array_equal(a, b)
    asked, make = [], T.generate
    monkeypatch.setattr(T, "generate", lambda *a, **k: asked.append(k.get("n_sharing")) or make(*a, **k))
    r = random.Random(2)
    for _ in range(8):
        data.train_sequence(r, 512, tok, 3.0, 0.0, 0.0, (0, 1, 0, 0, 0), hard_keys=1.0)
    assert len(asked) == 8 and all(1 <= k <= 4 for k in asked)
    with pytest.raises(SystemExit, match="--hard-keys"):
        data.data_options(_args(hard_keys=1.5))


_CLOCK_CHILD = """
import sys, time
from experiments.testbed.clock import ActiveClock
clock = ActiveClock(tick=0.05, gap=1.0)
a0, w0 = clock(), time.monotonic()
print("ready", flush=True)
sys.stdin.readline()
time.sleep(0.3)  # the heartbeat's first wake-up after a resume counts the gap
print(clock() - a0, time.monotonic() - w0, flush=True)
"""


def test_active_clock_leaves_out_time_stopped():
    """A run paused with SIGSTOP (e.g. to free the cores) keeps its training budget."""
    import signal
    import subprocess
    import time

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-c", _CLOCK_CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        assert child.stdout.readline().strip() == "ready"
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(3.0)
        os.kill(child.pid, signal.SIGCONT)
        child.stdin.write("go\n")
        child.stdin.flush()
        active, wall = map(float, child.stdout.readline().split())
    finally:
        child.kill()
        child.wait()
    assert wall >= 3.0
    assert 0.0 <= active <= wall - 2.5, (active, wall)  # the 3-s stop is left out (less a tick)


def test_grow_layers_keeps_the_function_and_trains_the_new_layers(tmp_path, tok):
    """--grow-after: the deeper model computes what the loaded one does (the new layers write zeros
    into the residual stream) and one step moves the new layers' output projections off zero."""
    small = config.make_config(_args(layers=2), 1536)
    params = init_params(small, jax.random.PRNGKey(2))
    deep_cfg = config.make_config(_args(layers=4), 1536)
    grown = surgery.grow_layers(params, [0, 1])
    assert jax.tree_util.tree_map(np.shape, grown) == jax.tree_util.tree_map(
        np.shape, init_params(deep_cfg, jax.random.PRNGKey(0)))
    np.testing.assert_array_equal(grown["layers"]["wq"][1], params["layers"]["wq"][0])  # a copy of layer 0
    assert not np.any(grown["layers"]["wo"][3]) and not np.any(grown["layers"]["mlp"]["down"][3])
    toks = np.asarray([[T.BOS_ID] + list(range(10, 70))], np.int32)
    np.testing.assert_allclose(forward_logits(grown, deep_cfg, toks), forward_logits(params, small, toks),
                               rtol=1e-5, atol=1e-5)

    out = export.export_hf(params, small, str(tmp_path))  # through --init-from's loader
    loaded = surgery.load_init(out, init_params(deep_cfg, jax.random.PRNGKey(0)), surgery.parse_grow_after("1,0"))
    assert not np.any(loaded["layers"]["wo"][1])
    with pytest.raises(SystemExit, match="shapes"):
        surgery.load_init(out, init_params(deep_cfg, jax.random.PRNGKey(0)))  # 2 layers into 4, not grown
    with pytest.raises(SystemExit, match="layer 2 does not exist"):
        surgery.grow_layers(params, [2])
    with pytest.raises(SystemExit, match="layer indices"):
        surgery.parse_grow_after("1,x")

    opt = optax.adamw(1e-3)
    step = objective.make_train_step(deep_cfg, opt, 64)
    batch = data.make_batch(0, 0, 2, 64, tok, _args(layers=4))
    new, _, loss, _ = step(grown, opt.init(grown), *batch)
    assert np.isfinite(float(loss)) and np.any(new["layers"]["wo"][1]) and np.any(new["layers"]["mlp"]["down"][3])


def test_portable_state_round_trip(tmp_path):
    """--save-state's files give back the params, the optimizer state, the step and the training
    time exactly; over the size limit the params fall back to bfloat16 and the moments are left out
    (a resumed run then starts fresh ones)."""
    from experiments.testbed import state as S

    cfg = config.make_config(_args(), 1536)
    params = init_params(cfg, jax.random.PRNGKey(0))
    opt = objective.make_optimizer(1e-3)
    g = jax.tree_util.tree_map(lambda a: 0.1 * np.ones_like(a), params)
    upd, opt_state = opt.update(g, opt.init(params), params)  # moments and count not zero
    params = optax.apply_updates(params, upd)
    info = S.save_state(str(tmp_path / "s"), params, opt_state, 7, 12.5, cfg)
    assert info["params_dtype"] == "float32" and info["opt_saved"]
    assert sorted(os.listdir(tmp_path / "s")) == ["opt.npz", "params.npz"]  # no temporary files left
    fresh = init_params(cfg, jax.random.PRNGKey(1))
    p2, o2, step, elapsed, meta = S.load_state(str(tmp_path / "s"), fresh, opt.init(fresh))
    assert (step, elapsed) == (7, 12.5) and meta["config"]["rope_theta"] == cfg.rope_theta
    for a, b in zip(jax.tree_util.tree_leaves((params, opt_state)), jax.tree_util.tree_leaves((p2, o2))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree_util.tree_structure(o2) == jax.tree_util.tree_structure(opt_state)

    small = S.save_state(str(tmp_path / "s"), params, opt_state, 8, 13.0, cfg, max_mb=0.2)
    assert small["params_dtype"] == "bfloat16" and not small["opt_saved"]
    assert not os.path.exists(tmp_path / "s" / "opt.npz")  # the stale step-7 moments are gone
    p3, o3, step, _, _ = S.load_state(str(tmp_path / "s"), fresh, opt.init(fresh))
    assert o3 is None and step == 8
    np.testing.assert_allclose(np.asarray(p3["embed"]), np.asarray(params["embed"]), rtol=1e-2, atol=1e-3)
    with pytest.raises(SystemExit, match="do not match"):
        S.load_state(str(tmp_path / "s"), init_params(config.make_config(_args(layers=3), 1536),
                                                      jax.random.PRNGKey(0)), None)


def _tiny_run(tmp_path, name, *extra):
    """train_testbed.main on a tiny model for about one step (run-dir, export and state under
    tmp_path/name: a fresh machine's disk); returns its metrics.jsonl records."""
    import json

    d = tmp_path / name
    argv = ["--layers", "2", "--d-model", "32", "--heads", "2", "--kv-heads", "1", "--ffn", "64",
            "--stages", "0:64:2", "--lr", "1e-3", "--constant-lr", "--warmup", "1000", "--minutes", "10",
            "--wall-minutes", "0.05", "--log-every", "1", "--final-lengths", "", "--eval-minutes", "100",
            "--run-dir", str(d / "run"), "--out", str(d / "export"), "--save-state", str(d / "state"), *extra]
    assert tt.main(argv) == 0
    assert sorted(os.listdir(d / "state")) == ["metrics.jsonl", "opt.npz", "params.npz"]
    return [json.loads(line) for line in open(d / "run" / "metrics.jsonl")]


def test_resume_state_continues_on_a_fresh_run_dir(tmp_path):
    """A run resumed from another run's --save-state folder (a new machine: an empty --run-dir)
    continues its step count, training time, learning-rate schedule and metrics log; without the
    optimizer state it re-warms fresh moments from the resumed step."""
    import shutil

    from experiments.testbed import state as S

    first = [r for r in _tiny_run(tmp_path, "a") if "loss" in r]
    s1 = first[-1]["step"]
    assert first[0]["step"] == 1 and first[0]["lr"] == pytest.approx(1e-6)  # warm-up: 1e-3 * 1 / 1000
    assert S.read_meta(str(tmp_path / "a" / "state"))["step"] == s1
    second = _tiny_run(tmp_path, "b", "--resume-state", str(tmp_path / "a" / "state"))
    assert [r for r in second if "loss" in r][:len(first)] == first  # the log carried over
    new = [r for r in second if "loss" in r][len(first):]
    assert new and new[0]["step"] == s1 + 1
    assert new[0]["lr"] == pytest.approx(1e-3 * (s1 + 1) / 1000)  # the schedule continues, no restart
    assert new[0]["elapsed"] > first[-1]["elapsed"]
    meta = S.read_meta(str(tmp_path / "b" / "state"))
    assert meta["step"] == new[-1]["step"] and meta["elapsed"] >= new[-1]["elapsed"]

    shutil.copytree(tmp_path / "a" / "state", tmp_path / "no_moments")
    os.remove(tmp_path / "no_moments" / "opt.npz")
    third = _tiny_run(tmp_path, "c", "--resume-state", str(tmp_path / "no_moments"))
    new = [r for r in third if "loss" in r][len(first):]
    assert new[0]["step"] == s1 + 1 and new[0]["lr"] == pytest.approx(1e-6)  # warm-up again


def test_pose_positions_are_sorted_unique_block_aligned_and_within_target(tok):
    """--pose-target: skip-wise ids (issue 53) are strictly increasing, below the target, each
    32-token block 32 consecutive ids from a multiple of 32; one gap falls a block or more before
    the first answer (the question's chunk lies away from the context); over many draws the
    windows reach both far (> 4x the window) and near extents."""
    L, target, bs = 256, 4096, data.BLOCK
    rng = np.random.default_rng(0)
    extents, gap_before_answer = [], 0
    for i in range(60):
        x, w = data.train_sequence(random.Random(i), L, tok, 3.0, 0.0, 0.0)
        pos = data.pose_positions(rng, L, target, w, 3.0, chunks=2 + i % 3)
        assert pos.shape == (L,) and pos.dtype == np.int32
        assert pos[0] == 0 and (np.diff(pos) > 0).all() and pos[-1] < target
        blocks = pos.reshape(L // bs, bs)
        assert (blocks[:, 0] % bs == 0).all() and (np.diff(blocks, axis=1) == 1).all()
        jumps = np.nonzero(np.diff(pos) > 1)[0] + 1  # token indices where a chunk starts after a gap
        assert (jumps % bs == 0).all() and len(jumps) <= 1 + i % 3
        a = np.nonzero(w == 3.0)[0][0]
        gap_before_answer += any(a - 2 * bs < j <= a - bs for j in jumps)
        extents.append(pos[-1] + 1)
    assert gap_before_answer >= 40  # no gap only when the skip drawn there was 0 blocks
    assert max(extents) > 4 * L and min(extents) < 2 * L
    np.testing.assert_array_equal(data.pose_positions(rng, L, L, w), np.arange(L))  # nothing to skip


def test_pose_tail_keeps_the_blocks_before_the_answer_next_to_it(tok):
    """--pose-tail-blocks t (stage 35): the answer's chunk starts 1..t blocks before the answer's
    block, so the run of contiguous ids that ends at the answer spans up to t blocks and no other
    cut falls inside it (stages 32-34, t = 1: one block, longer only where a skip of 0 blocks was
    drawn, shorter where another cut fell in the answer's block); t = 1 is their cut draw for
    draw."""
    L, target, bs = 1024, 16384, data.BLOCK

    def runs(t):  # blocks of contiguous ids that end at the first answer token, per draw
        out = []
        for i in range(80):
            x, w = data.train_sequence(random.Random(i), L, tok, 3.0, 0.0, 0.0)
            a = int(np.nonzero(w == 3.0)[0][0])
            pos = data.pose_positions(np.random.default_rng(i), L, target, w, 3.0, chunks=3, tail_blocks=t)
            assert pos[0] == 0 and (np.diff(pos) > 0).all() and pos[-1] < target
            jumps = np.nonzero(np.diff(pos[:a + 1]) > 1)[0] + 1
            out.append(a // bs - (int(jumps[-1]) if len(jumps) else 0) // bs)
            if t == 1:
                np.testing.assert_array_equal(pos, data.pose_positions(
                    np.random.default_rng(i), L, target, w, 3.0, chunks=3))
        return np.array(out)

    one, eight = runs(1), runs(8)
    assert (one == 1).mean() >= 0.8  # stages 32-34: the question's block alone (or a cut in the answer's)
    assert (eight >= 1).all()  # no other cut inside the tail
    near = (eight >= 2) & (eight <= 8)
    assert near.mean() >= 0.6 and len(set(eight[near])) >= 5  # 2..8 blocks, spread


def test_pose_flag_off_keeps_the_batch_and_on_adds_positions(tok):
    """Without --pose-target the batch is the 4 arrays it always was; with it, the same 4 arrays
    plus position ids: skip-wise for a --pose-prob share of the rows of length >= --pose-min-len,
    arange for the rest."""
    base = data.make_batch(3, 0, 6, 128, tok, _args(seed=0), dense=0.3)
    assert len(base) == 4
    for off in (_args(seed=0, pose_target=0), _args(seed=0, pose_target=0, pose_prob=1.0, pose_chunks=3)):
        for a, b in zip(base, data.make_batch(3, 0, 6, 128, tok, off, dense=0.3)):
            np.testing.assert_array_equal(a, b)
    on = data.make_batch(3, 0, 6, 128, tok, _args(seed=0, pose_target=2048, pose_prob=0.5), dense=0.3)
    assert len(on) == 5
    for a, b in zip(base, on[:4]):
        np.testing.assert_array_equal(a, b)
    pos = on[4]
    assert pos.shape == (6, 128) and (np.diff(pos, axis=1) > 0).all() and (pos < 2048).all()
    skipped = (pos[:, -1] > 127)
    assert 0 < skipped.sum() < 6 and (pos[~skipped] == np.arange(128)).all()
    short = data.make_batch(3, 0, 6, 128, tok, _args(seed=0, pose_target=2048, pose_min_len=256), dense=0.3)
    assert (short[4] == np.arange(128)).all()  # a 128-token stage under --pose-min-len 256
    for bad in (dict(pose_target=100), dict(pose_target=2048, pose_chunks=1),
                dict(pose_target=2048, pose_prob=1.5), dict(pose_target=16384, max_positions=8192),
                dict(pose_target=2048, pose_tail_blocks=0)):
        with pytest.raises(SystemExit, match="--pose"):
            data.pose_options(_args(**bad))


def test_two_copy_logits_at_skipwise_positions_match_the_dense_mask(tok):
    """Both copies read the same skip-wise ids: the chunked forward equals the dense two-copy mask
    (over token blocks) with positions concat(pos, pos), and pos = arange is the forward without
    positions."""
    a = _args(logits_shift=True)
    cfg = config.make_config(a, tok.get_vocab_size())
    params = init_params(cfg, jax.random.PRNGKey(2))
    xt, x0, _, _, pos = data.make_batch(1, 0, 2, 96, tok, _args(seed=0, pose_target=4096), dense=0.0)
    assert (pos[:, -1] > 95).any()
    got = np.asarray(objective.two_copy_hidden_at(params, cfg, xt, x0, pos, chunk=64))
    mask = np.broadcast_to(objective.two_copy_mask(96), (2, 192, 192))
    ref = np.asarray(forward_hidden(params, cfg, np.concatenate([xt, x0], 1), np.concatenate([pos, pos], 1),
                                    mask=mask))
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4)
    ar = np.tile(np.arange(96, dtype=np.int32), (2, 1))
    np.testing.assert_allclose(np.asarray(objective.two_copy_logits(params, cfg, xt, x0, pos=ar)),
                               np.asarray(objective.two_copy_logits(params, cfg, xt, x0)), rtol=2e-5, atol=2e-5)
    step = objective.make_train_step(cfg, objective.make_optimizer(1e-3))
    _, _, loss, _ = step(params, objective.make_optimizer(1e-3).init(params), xt, x0, xt == T.MASK_ID,
                         np.ones_like(xt, np.float32), pos)
    assert np.isfinite(float(loss))


def test_eval_plan_flags():
    """--eval-lengths: one probe per length, --eval-n examples up to 2048 and --eval-long-n above;
    lengths past --max-positions and unknown tasks are refused by name."""
    a = tt.build_parser().parse_args(["--eval-lengths", "512,8192", "--eval-n", "16", "--eval-long-n", "3",
                                      "--eval-tasks", "passkey,multikey", "--max-positions", "33280"])
    assert tt.eval_plan(a) == ([(512, 16), (8192, 3)], ("passkey", "multikey"))
    assert tt.eval_plan(tt.build_parser().parse_args([]))[0] is None
    for flag, value in (("--eval-lengths", "512,8192"), ("--eval-tasks", "docqa")):
        with pytest.raises(SystemExit, match=flag):
            tt.eval_plan(tt.build_parser().parse_args([flag, value]))


def test_long_cpu_script_command_parses(tmp_path):
    """experiments/testbed/train_long_cpu.sh (stages 32-42; DRY_RUN=1 prints the command) runs
    train_testbed.py with flags that parse and pass the startup checks: skip-wise positions to
    32768, an export that takes 32768-token prompts, the held-out probe at 4096 and 8192; stage 33
    adds YaRN x16 over 2048 and the long answer to the probe, stage 34 Dynamic-YaRN x16 over 2048,
    stage 35 stage 34's flags plus the answer's tail, stage 36 stage 35's plus hard keys, stage 37
    stage 36's plus real long rows, stage 38 stage 37's with the long rows' own mix, 39 the most distractors, 40 the prefix K / V with gradient, 41 the whole prefix pass with gradient, 42 more
    long rows in the layout multi-key misses, each
    from the previous stage's state or, on a machine without it, the stage's carried state in the
    work tree, else the previous stage's committed export."""
    import subprocess

    script = os.path.join(ROOT, "experiments", "testbed", "train_long_cpu.sh")
    s32 = tmp_path / "s32"
    s32.mkdir()
    (s32 / "params.npz").write_bytes(b"")  # stage 33 copies stage 32's state on its first start
    parsed = {}
    for stage in ("32", "33", "34", "35", "36", "37", "38", "39", "40", "41", "42"):
        env = dict(os.environ, DRY_RUN="1", STAGE=stage, TB_LONG_DIR=str(tmp_path / f"tb{stage}"),
                   STAGE32_STATE=str(s32), STAGE34_STATE=str(tmp_path / "none"),
                   STAGE35_STATE=str(tmp_path / "none"), STAGE36_STATE=str(tmp_path / "none"),
                   STAGE36_CARRIED=str(tmp_path / "none"), STAGE37_STATE=str(tmp_path / "none"),
                   STAGE37_CARRIED=str(tmp_path / "none"), STAGE38_STATE=str(tmp_path / "none"),
                   STAGE38_CARRIED=str(tmp_path / "none"), STAGE39_STATE=str(tmp_path / "none"),
                   STAGE39_CARRIED=str(tmp_path / "none"), STAGE40_STATE=str(tmp_path / "none"),
                   STAGE40_CARRIED=str(tmp_path / "none"), STAGE41_STATE=str(tmp_path / "none"),
                   STAGE41_CARRIED=str(tmp_path / "none"), CARRIED=str(tmp_path / "no_carry"))
        out = subprocess.run(["bash", script], env=env, capture_output=True, text=True, check=True).stdout
        argv = out.splitlines()
        assert argv[:3] == ["nice", "-n", "19"] and argv[4] == "experiments/train_testbed.py"
        parsed[stage] = args = tt.build_parser().parse_args(argv[5:])
        tt.check_data_flags(args)
        assert args.pose_target == 32768 and args.max_positions >= 32768 + 512
        assert [L for L, _ in tt.eval_plan(args)[0]] == [512, 4096, 8192]
        assert args.run_dir == str(tmp_path / f"tb{stage}" / "run")
        cfg = tt.make_config(args, 1536)
        if stage == "33":
            assert (cfg.rope_scaling.type, cfg.rope_scaling.factor) == ("yarn", 16.0)
            assert "longanswer" in tt.eval_plan(args)[1]
            assert (tmp_path / "tb33" / "state" / "params.npz").exists()
        elif stage in ("34", "35", "36", "37", "38", "39", "40", "41", "42"):  # Dynamic-YaRN x16 over 2048, positions to 33280
            s = cfg.rope_scaling
            assert (s.type, s.factor, s.original_max_position_embeddings) == ("dynamic_yarn", 16.0, 2048)
            assert cfg.max_position_embeddings == 33280 and "longanswer" in tt.eval_plan(args)[1]
        else:
            assert cfg.rope_scaling is None
        if stage < "35":
            assert args.init_from == "maskahead_jax/testbed" and args.pose_tail_blocks == 1
    where = {"run_dir", "save_state", "resume_state", "out", "init_from"}
    for prev, stage, flags, fallback in (
            ("34", "35", {"pose_tail_blocks", "eval_minutes", "export_minutes"}, "stage34_step234"),
            ("35", "36", {"hard_keys"}, "stage35_step790"),
            ("36", "37", {"real_long"}, "stage35_step790"),
            ("37", "38", {"real_long_task_weights", "real_long_edge_depths"}, "stage35_step790"),
            ("38", "39", {"real_long_task_weights", "real_long_most_distractors"}, "stage35_step790"),
            ("39", "40", {"real_long_prefix_kv_grad"}, "stage35_step790"),
            ("40", "41", {"real_long_prefix_kv_grad", "real_long_prefix_full_grad"}, "stage35_step790"),
            ("41", "42", {"real_long_hard_keys", "real_long_edge_depths", "real_long_task_weights"},
             "stage35_step790")):
        a, b = vars(parsed[prev]), vars(parsed[stage])
        same_fallback = {"init_from"} if prev in ("36", "37", "38", "39", "40", "41") else set()  # 36-42 all fall back to stage 35's
        assert {k for k in a if a[k] != b[k]} == (where - same_fallback) | flags
        # no previous state here: the previous stage's committed export
        assert b["init_from"] == f"experiments/testbed/exports/{fallback}"
        assert os.path.exists(os.path.join(ROOT, b["init_from"], "model.safetensors"))
    assert parsed["35"].pose_tail_blocks == parsed["36"].pose_tail_blocks == 24 and parsed["36"].hard_keys == 0.5
    assert parsed["37"].real_long == "8192:512:3" and parsed["40"].real_long_prefix_kv_grad
    assert tt.prefix_grad_mode(parsed["41"]) == "full" and tt.prefix_grad_mode(parsed["40"]) == "kv"
    assert tt.prefix_grad_mode(parsed["42"]) == "full" and float(parsed["42"].real_long_hard_keys) == 1.0
    assert (float(parsed["42"].real_long_edge_depths), parsed["42"].real_long_task_weights) == (0.8, "0.05,0.5,0.05,0.3,0.1")
    # stage 37 on a new machine without stage 36's state: stage 36's carried state is its start
    carried36 = tmp_path / "carry36only"
    carried36.mkdir()
    (carried36 / "params.npz").write_bytes(b"36")
    env = dict(os.environ, DRY_RUN="1", STAGE="37", TB_LONG_DIR=str(tmp_path / "tb37b"), CARRIED=str(tmp_path / "none"),
               STAGE36_STATE=str(tmp_path / "none"), STAGE36_CARRIED=str(carried36))
    out = subprocess.run(["bash", script], env=env, capture_output=True, text=True, check=True).stdout
    assert tt.build_parser().parse_args(out.splitlines()[5:]).init_from == "maskahead_jax/testbed"
    assert (tmp_path / "tb37b" / "state" / "params.npz").read_bytes() == b"36"
    # a new machine with this stage's carried state in the work tree: resumed from it (a copy in
    # $D/state), no --init-from; CARRY=1 writes it from $D/state
    carried = tmp_path / "carry36"
    carried.mkdir()
    (carried / "params.npz").write_bytes(b"x")
    env = dict(os.environ, DRY_RUN="1", STAGE="36", TB_LONG_DIR=str(tmp_path / "tb36b"), CARRIED=str(carried),
               STAGE35_STATE=str(tmp_path / "none"))
    out = subprocess.run(["bash", script], env=env, capture_output=True, text=True, check=True).stdout
    args = tt.build_parser().parse_args(out.splitlines()[5:])
    assert args.init_from == "maskahead_jax/testbed" and args.resume_state == str(tmp_path / "tb36b" / "state")
    assert (tmp_path / "tb36b" / "state" / "params.npz").read_bytes() == b"x"


def test_carried_state_keeps_the_clock_and_bf16_params_without_moments(tmp_path):
    """state.carry: the portable state slimmed for the work tree: params in bfloat16 (what a
    resume reads back as float32), step / elapsed / config and metrics.jsonl kept, opt.npz left
    out (the resumed run warms fresh moments up from that step)."""
    import ml_dtypes

    from experiments.testbed import state as st

    params = {"a": jnp.linspace(-1, 1, 96, dtype=jnp.float32).reshape(8, 12), "b": {"c": jnp.ones(5, jnp.float32) / 3}}
    opt = tt.make_optimizer(1e-3)
    info = st.save_state(str(tmp_path / "s"), params, opt.init(params), 417, 1234.5)
    assert info["opt_saved"] and info["params_dtype"] == "float32"
    (tmp_path / "s" / "metrics.jsonl").write_text('{"step": 410, "elapsed": 1200.0, "exported": "x"}\n')
    got = st.carry(str(tmp_path / "s"), str(tmp_path / "c"))
    assert got["step"] == 417 and sorted(os.listdir(tmp_path / "c")) == ["metrics.jsonl", "params.npz"]
    p, o, step, elapsed, meta = st.load_state(str(tmp_path / "c"), params, opt.init(params))
    assert o is None and step == 417 and elapsed == 1234.5 and meta["params_dtype"] == "bfloat16"
    bf16 = lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(np.asarray(p["a"]), bf16(params["a"])) and np.array_equal(np.asarray(p["b"]["c"]), bf16(params["b"]["c"]))
    assert (tmp_path / "c" / "metrics.jsonl").read_text() == (tmp_path / "s" / "metrics.jsonl").read_text()
    again = st.carry(str(tmp_path / "c"), str(tmp_path / "c2"))  # a carried state carries as it is
    assert again["step"] == 417
    with pytest.raises(SystemExit, match="no portable state"):
        st.carry(str(tmp_path / "none"), str(tmp_path / "c3"))


def test_resumed_timers_count_from_the_last_probe_and_export(tmp_path):
    """A resumed run's probe / export timers start at the training time of the last "eval" /
    "exported" record (at most the resumed time), not at the resume: a run stopped every session
    before --export-minutes still exports on schedule. No record: the resumed time."""
    log = tmp_path / "metrics.jsonl"
    recs = [{"step": 5, "elapsed": 100.0, "L": 512, "loss": 2.0}, {"step": 9, "elapsed": 1800.0, "eval": {}},
            {"step": 12, "elapsed": 2700.0, "exported": "x"}, {"step": 15, "elapsed": 3000.0, "L": 512},
            {"step": 30, "elapsed": 5000.0, "eval": {}}]  # logged after the state the run resumes from
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert tt.last_logged(str(log), "exported", 4000.0) == 2700.0
    assert tt.last_logged(str(log), "eval", 4000.0) == 4000.0  # capped at the resumed time
    assert tt.last_logged(str(log), "eval", 6000.0) == 5000.0
    assert tt.last_logged(str(tmp_path / "none.jsonl"), "eval", 321.0) == 321.0
    assert tt.last_logged(None, "exported", 0.0) == 0.0
