"""RoPE as the checkpoint says (issue 51 item 2): rope_theta and rope_scaling / rope_parameters read
by the converters, applied by the model, and the user knobs (load_pretrained's rope_theta /
rope_scaling / max_position_embeddings, the CLI's --rope-theta / --rope-scaling / --max-positions).

Without torch: the scaled types reduce to plain RoPE where their formulas say they must; configs
and knobs parse or are refused with a ConfigError naming the field. With torch (CI's 3.11 job):
inverse frequencies, attention factors and cos / sin equal transformers' ROPE_INIT_FUNCTIONS and
rotary embedding class past original_max_position_embeddings, and logits of tiny random Qwen2 /
Qwen3 / Llama (LLaDA keys) checkpoints equal transformers' own models at 200 positions (original
length 64) within 1e-4 in float32.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

import maskahead_jax as mj
from converters.hf_config import model_config_from_hf
from maskahead_jax import cli
from maskahead_jax.config import ConfigError, ModelConfig
from maskahead_jax.model.layers import rope_tables
from maskahead_jax.model.rope import RopeScaling, for_run, parse_scaling, scaling_from_hf, with_rope
from maskahead_jax.model.rope_frequencies import static_frequencies

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="torch parity runs in CI's Python 3.11 job (.ci/run)")
TESTBED = os.path.join(os.path.dirname(mj.__file__), "testbed")
T, ORIG, FP32_TOL = 200, 64, 1e-4


def _pos(t: int, b: int = 1) -> jnp.ndarray:
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def _close(a, b, tol=2e-5):
    return float(jnp.abs(jnp.asarray(a) - jnp.asarray(b)).max()) <= tol


# ------------------------------------------------------------------ the formulas (no torch)


def test_linear_is_plain_rope_at_divided_positions():
    s = RopeScaling("linear", factor=4.0)
    cos, sin = rope_tables(_pos(T), 16, 1e4, s)
    pc, ps = rope_tables(_pos(T).astype(jnp.float32) / 4.0, 16, 1e4)
    assert _close(cos, pc) and _close(sin, ps)
    assert not _close(cos, rope_tables(_pos(T), 16, 1e4)[0], 0.1)  # and it is not plain RoPE


@pytest.mark.parametrize("s", [RopeScaling("yarn", factor=1.0, original_max_position_embeddings=ORIG),
                               RopeScaling("llama3", factor=1.0, original_max_position_embeddings=ORIG),
                               RopeScaling("dynamic", factor=4.0, original_max_position_embeddings=ORIG)],
                         ids=["yarn-factor-1", "llama3-factor-1", "dynamic-within-original"])
def test_types_reduce_to_plain_rope(s):
    """yarn / llama3 at factor 1 and dynamic NTK up to its original length are plain RoPE."""
    t = T if s.type != "dynamic" else ORIG
    cos, sin = rope_tables(_pos(t), 16, 1e4, s)
    pc, ps = rope_tables(_pos(t), 16, 1e4)
    assert _close(cos, pc) and _close(sin, ps)


def test_dynamic_grows_with_length_and_engine_rule_fixes_it():
    s = RopeScaling("dynamic", factor=4.0, original_max_position_embeddings=ORIG)
    cos, _ = rope_tables(_pos(T), 16, 1e4, s)
    assert not _close(cos, rope_tables(_pos(T), 16, 1e4)[0], 0.1)
    # the engine's rule: frequencies fixed at the run's length; equal to a forward of that length
    fixed = dataclasses.replace(s, seq_len=T)
    assert _close(rope_tables(_pos(T), 16, 1e4, fixed)[0], cos)
    # ... whatever the positions of the chunk (a prefill chunk in the middle of the run)
    chunk = _pos(ORIG + 32)[:, ORIG:]
    assert _close(rope_tables(chunk, 16, 1e4, fixed)[0], cos[:, ORIG:ORIG + 32])
    # the per-forward rule would rotate that chunk with another base than the rest of the run
    assert not _close(rope_tables(chunk, 16, 1e4, s)[0], cos[:, ORIG:ORIG + 32], 1e-3)
    cfg = ModelConfig("sdar", "qwen3", 48, 32, 1, 4, 2, 8, 48, rope_scaling=s, mask_token_id=1)
    assert for_run(cfg, 300).rope_scaling.seq_len == 300
    assert for_run(cfg.replace(rope_scaling=RopeScaling("linear", 2.0)), 300).rope_scaling.seq_len == 0


def test_longrope_short_and_long_factors():
    ones, long = (1.0,) * 8, tuple(float(2 ** i) for i in range(8))
    s = RopeScaling("longrope", factor=4.0, original_max_position_embeddings=ORIG, short_factor=ones,
                    long_factor=long)
    att = static_frequencies(16, 1e4, s)[1]
    assert att == pytest.approx((1 + np.log(4.0) / np.log(ORIG)) ** 0.5)
    short_cos, _ = rope_tables(_pos(ORIG), 16, 1e4, s)
    assert _close(short_cos / att, rope_tables(_pos(ORIG), 16, 1e4)[0])
    long_cos, _ = rope_tables(_pos(T), 16, 1e4, s)
    assert not _close(long_cos[:, :ORIG] / att, short_cos / att, 1e-2)  # past the original: long factors


# ------------------------------------------------------------------ configs and knobs (no torch)

QWEN2 = {"model_type": "qwen2", "bd_size": 32, "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48, "mask_token_id": 63,
         "eos_token_id": 62, "max_position_embeddings": 4096, "rope_theta": 1e6}


def test_config_reads_v4_and_v5_rope_fields():
    v4 = model_config_from_hf({**QWEN2, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                          "original_max_position_embeddings": 4096}})
    assert (v4.rope_scaling.type, v4.rope_scaling.factor, v4.rope_theta) == ("yarn", 4.0, 1e6)
    assert v4.max_position_embeddings == 16384  # the length the scaling is made for
    v5 = model_config_from_hf({**{k: v for k, v in QWEN2.items() if k != "rope_theta"},
                               "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}})
    assert (v5.rope_scaling, v5.rope_theta) == (RopeScaling("linear", 2.0), 5e5)
    plain = model_config_from_hf({**QWEN2, "rope_scaling": {"rope_type": "default"}})
    assert plain.rope_scaling is None and plain.rope_theta == 1e6
    dyn = model_config_from_hf({**QWEN2, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    assert dyn.rope_scaling.original_max_position_embeddings == 4096 and dyn.max_position_embeddings == 8192
    assert RopeScaling("yarn", 4.0, 64, mscale=1.0).to_hf() and scaling_from_hf(
        v4.rope_scaling.to_hf(), 16384) == v4.rope_scaling  # a config written back reads the same


@pytest.mark.parametrize("rope, match", [
    ({"type": "su", "factor": 2.0}, "rope type 'su' is not supported"),
    ({"rope_type": "ntk-by-parts"}, "'ntk-by-parts' is not supported"),
    ({"type": "linear"}, r"rope_scaling \(linear\) lacks required field\(s\): factor"),
    ({"rope_type": "llama3", "factor": 8.0}, "lacks required field.*low_freq_factor, high_freq_factor"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 4}, "lacks required field.*long_factor"),
    ({"rope_type": "yarn", "factor": 0.5}, r"factor must be a number >= 1, got 0.5"),
    ({"rope_type": "yarn", "factor": "4"}, "factor must be a finite number"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 3}, "need 4 entries"),
])
def test_bad_rope_config_is_one_error_naming_it(rope, match):
    with pytest.raises(ConfigError, match=match):
        model_config_from_hf({**QWEN2, "rope_scaling": rope})


def test_bad_rope_theta_refused():
    for theta in (0, -1e4, float("nan"), "1e6"):
        with pytest.raises(ConfigError, match="rope_theta must be a positive number"):
            model_config_from_hf({**QWEN2, "rope_theta": theta})


def test_knob_strings():
    assert parse_scaling("yarn:4", 8192) == RopeScaling("yarn", 4.0, 8192)
    assert parse_scaling("dynamic:2:4096", 8192) == RopeScaling("dynamic", 2.0, 4096)
    assert parse_scaling("none", 8192) == "none"
    assert parse_scaling({"type": "linear", "factor": 2}, 8192) == RopeScaling("linear", 2.0, 8192)
    for bad, match in (("yarn", "expected TYPE:FACTOR"), ("yarn:x", "FACTOR must be a number"),
                       ("rope:2", "expected TYPE:FACTOR"), ("longrope:2", "pass a dict"),
                       ("linear:0.5", "factor must be a number >= 1")):
        with pytest.raises(ConfigError, match=match):
            parse_scaling(bad, 8192)


def test_load_pretrained_knobs():
    base = mj.load_pretrained(TESTBED).config
    m = mj.load_pretrained(TESTBED, rope_theta=4 * base.rope_theta)
    assert m.config == base.replace(rope_theta=4 * base.rope_theta)  # LongLLaDA's theta scaling
    m = mj.load_pretrained(TESTBED, rope_scaling="yarn:4")
    assert m.config.rope_scaling == RopeScaling("yarn", 4.0, base.max_position_embeddings)
    assert m.config.max_position_embeddings == 4 * base.max_position_embeddings
    assert with_rope(m.config, rope_scaling="none").rope_scaling is None
    assert with_rope(base, max_position_embeddings=20000).max_position_embeddings == 20000
    with pytest.raises(ConfigError, match="rope_theta must be a positive number"):
        mj.load_pretrained(TESTBED, rope_theta=-1.0)
    with pytest.raises(ConfigError, match="rope type 'bogus' is not supported"):
        mj.load_pretrained(TESTBED, rope_scaling={"rope_type": "bogus", "factor": 2})


def test_forward_applies_the_config_scaling():
    """The model's forward reads cfg.rope_scaling (the torch tests check its values)."""
    from tiny import tiny_model

    m = tiny_model("sdar", seed=3, scale=1.0)
    lin = mj.Model(m.config.replace(rope_scaling=RopeScaling("linear", 4.0)), m.params)
    toks = np.random.default_rng(0).integers(0, 40, (1, 48))
    assert not _close(mj.forward(lin, toks), mj.forward(m, toks), 1e-2)


def test_cli_flags(capsys):
    args = cli.build_parser().parse_args(["generate", "--ids", "5,6", "--rope-scaling", "yarn:2",
                                          "--rope-theta", "40000"])
    cfg = cli.model_config(None, None, args)
    assert (cfg.rope_theta, cfg.rope_scaling.type, cfg.rope_scaling.factor) == (40000.0, "yarn", 2.0)
    args = cli.build_parser().parse_args(["eval", "--out", "x", "--max-positions", "12345"])
    assert cli.model_config(None, None, args).max_position_embeddings == 12345
    assert cli.main(["generate", "--ids", "5,6", "--rope-scaling", "ntk:2"]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and "--rope-scaling" in err[0] and "ntk:2" in err[0]


def test_dynamic_yarn_is_plain_up_to_the_original_length_and_yarn_of_the_needed_factor_beyond():
    """dynamic_yarn (ours, the YaRN paper's Dynamic-YaRN): at a length n it is YaRN with factor
    clip(n / original, 1, factor) (frequencies and attention temperature), so plain RoPE up to
    the original length; the traced per-forward rule (seq_len 0) equals the static one; the knob
    parses, survives `load_pretrained`, and an export writes it under our own config key
    (`maskahead_rope_scaling`, which the loader reads over transformers' `rope_scaling`)."""
    from maskahead_jax.model.rope import hf_fields

    d = RopeScaling("dynamic_yarn", factor=8.0, original_max_position_embeddings=ORIG)
    yarn = lambda f: RopeScaling("yarn", factor=f, original_max_position_embeddings=ORIG)
    for n, f in ((40, None), (ORIG, None), (100, 100 / ORIG), (3 * ORIG, 3.0), (20 * ORIG, 8.0)):
        got, att = static_frequencies(16, 1e4, d, seq_len=n)
        want, watt = static_frequencies(16, 1e4, yarn(f) if f else None)
        assert np.array_equal(got, want) and att == pytest.approx(watt)
        per_forward = rope_tables(_pos(n), 16, 1e4, d)  # seq_len 0: the forward's own length, traced
        fixed = rope_tables(_pos(n), 16, 1e4, dataclasses.replace(d, seq_len=n))
        assert _close(per_forward[0], fixed[0], 1e-5) and _close(per_forward[1], fixed[1], 1e-5)  # fp32 rounding
    assert _close(rope_tables(_pos(3 * ORIG), 16, 1e4, d)[0], rope_tables(_pos(3 * ORIG), 16, 1e4, yarn(3.0))[0], 1e-5)
    assert parse_scaling("dynamic_yarn:16:2048", 4096) == RopeScaling("dynamic_yarn", 16.0, 2048)
    assert scaling_from_hf(d.to_hf(), 512) == d
    cfg = ModelConfig("sdar", "qwen3", 48, 32, 1, 4, 2, 8, 48, rope_scaling=d, mask_token_id=1)
    assert for_run(cfg, 300).rope_scaling.seq_len == 300
    assert hf_fields(cfg) == {"maskahead_rope_scaling": d.to_hf()}
    hf = json.load(open(os.path.join(TESTBED, "config.json")))
    hf.update(rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096},
              maskahead_rope_scaling=RopeScaling("dynamic_yarn", 13.0, 2560).to_hf())
    back = model_config_from_hf(hf)
    assert back.rope_scaling == RopeScaling("dynamic_yarn", 13.0, 2560) and back.max_position_embeddings == 33280
    model = mj.load_pretrained(TESTBED, rope_scaling="dynamic_yarn:4:2048", max_position_embeddings=8192)
    assert model.config.rope_scaling == RopeScaling("dynamic_yarn", 4.0, 2048)
    assert model.config.max_position_embeddings == 8192


def test_dynamic_yarn_gives_each_row_of_a_batch_its_own_factor():
    """Traced dynamic_yarn reads each row's largest position (a training batch mixes plain windows
    with skip-wise ones far past the original length): every row of a batch gets the tables it
    would get alone, so a plain row stays plain RoPE next to a long one."""
    d = RopeScaling("dynamic_yarn", factor=8.0, original_max_position_embeddings=ORIG)
    t = 40
    pos = jnp.stack([jnp.arange(t), jnp.arange(t) * 7, jnp.arange(t) * 30]).astype(jnp.int32)  # 40, 274, 1171
    cos, sin = rope_tables(pos, 16, 1e4, d)
    for i in range(3):
        c1, s1 = rope_tables(pos[i:i + 1], 16, 1e4, d)
        assert _close(cos[i:i + 1], c1, 1e-6) and _close(sin[i:i + 1], s1, 1e-6)
    assert _close(cos[:1], rope_tables(pos[:1], 16, 1e4, None)[0], 1e-6)  # within ORIG: plain
    assert not _close(cos[2:], rope_tables(pos[2:], 16, 1e4, None)[0], 1e-2)


def test_dynamic_yarn_generates_as_plain_rope_within_the_trained_length():
    """A run whose (bucketed) prompt plus new blocks fit the original length generates the same
    tokens under dynamic_yarn as under plain RoPE; one past it generates as YaRN of its own
    factor (the run's length: the prompt padded to its bucket plus the whole new blocks)."""
    from tiny import tiny_model

    m = tiny_model("sdar", num_layers=2)
    gen = mj.GenerationConfig(max_new_tokens=16, stop_at_eos=False)
    rng = np.random.RandomState(0)
    short = [list(map(int, rng.randint(4, 40, size=40)))]  # 40 + 16 <= 64
    long = [list(map(int, rng.randint(4, 40, size=150)))]  # 150 + 16: factor 166 / 64
    run = lambda prompts, rope: mj.generate(mj.Model(m.config.replace(rope_scaling=rope, max_position_embeddings=1024),
                                                     m.params), prompts, gen, bucket=8).tokens
    assert run(short, RopeScaling("dynamic_yarn", 8.0, ORIG)) == run(short, None)
    n = 152 + 16  # the run's total length: the prompt in its bucket of 8, the whole new blocks (for_run)
    dyn = run(long, RopeScaling("dynamic_yarn", 8.0, ORIG))
    assert dyn == run(long, RopeScaling("yarn", n / ORIG, ORIG)) and dyn != run(long, None)


def test_generate_fixes_dynamic_rope_at_the_run_length():
    """Every generate core runs under the config `for_run` fixes at the padded prompt plus the
    whole blocks of the run (here 64 + 2 blocks of 8), whatever the core."""
    engine = importlib.import_module("maskahead_jax.engine.generate")  # the package exports the function
    cfg = ModelConfig("sdar", "qwen3", 48, 32, 1, 4, 2, 8, 48, mask_token_id=47, block_size=8,
                      rope_scaling=RopeScaling("dynamic", 4.0, 16))
    gen = mj.GenerationConfig(max_new_tokens=13).resolve(cfg)
    core = engine._with_attention(lambda *a, cfg, **k: cfg)
    got = core(None, jnp.zeros((1, 64), jnp.int32), None, None, cfg=cfg, gen=gen, policy=None, cache_dtype=None)
    assert got.rope_scaling == dataclasses.replace(cfg.rope_scaling, seq_len=64 + 16)
    plain = cfg.replace(rope_scaling=None)
    assert core(None, jnp.zeros((1, 64), jnp.int32), None, None, cfg=plain, gen=gen, policy=None,
                cache_dtype=None) is plain


# ------------------------------------------------------------------ against transformers (torch)

CASES = {  # rope parameters (and max_position_embeddings) of each type, original length 64
    "linear": ({"rope_type": "linear", "factor": 4.0}, ORIG),
    "dynamic": ({"rope_type": "dynamic", "factor": 4.0}, ORIG),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG}, 4 * ORIG),
    "yarn-mscale": ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIG, "mscale": 0.707,
                     "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2, "truncate": False}, 8 * ORIG),
    "yarn-attention-factor": ({"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": ORIG,
                               "attention_factor": 1.3}, 3 * ORIG),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": ORIG}, 8 * ORIG),
    "longrope": ({"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.7], "long_factor": [1.0, 2.0, 4.0, 8.0],
                  "original_max_position_embeddings": ORIG}, 4 * ORIG),
}


def _hf_config(name: str, theta: float = 1e4):
    from transformers import Qwen2Config

    rope, max_pos = CASES[name]
    return Qwen2Config(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                       num_hidden_layers=1, max_position_embeddings=max_pos,
                       rope_parameters={**rope, "rope_theta": theta})


@needs_torch
@pytest.mark.parametrize("name", list(CASES))
def test_frequencies_and_tables_match_transformers(name):
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    hfc = _hf_config(name)
    ours = model_config_from_hf({**QWEN2, "hidden_size": 32, "num_attention_heads": 4, "rope_theta": 1e4,
                                 "max_position_embeddings": hfc.max_position_embeddings,
                                 "rope_parameters": dict(CASES[name][0])})
    s = ours.rope_scaling
    for n in (ORIG // 2, T):  # within and past the original length
        inv, att = ROPE_INIT_FUNCTIONS[s.type](hfc, None, seq_len=n)
        got_inv, got_att = static_frequencies(ours.rope_dim, 1e4, s, seq_len=n)
        np.testing.assert_allclose(got_inv, inv.numpy(), rtol=1e-6)
        assert got_att == pytest.approx(att, rel=1e-7)
        rot = Qwen2RotaryEmbedding(hfc)  # fresh: dynamic / longrope keep state across calls
        x = torch.zeros(1, n, 8)
        cos, sin = rot(x, torch.arange(n)[None])
        c, s_ = rope_tables(_pos(n), ours)
        assert np.abs(np.asarray(c) - cos.numpy()).max() <= 2e-5
        assert np.abs(np.asarray(s_) - sin.numpy()).max() <= 2e-5


PARITY = {  # (builder, rope parameters, max positions, mask): every type on Qwen2, some on Qwen3 / Llama
    "qwen2-linear": ("qwen2", "linear"), "qwen2-dynamic": ("qwen2", "dynamic"), "qwen2-yarn": ("qwen2", "yarn"),
    "qwen2-llama3": ("qwen2", "llama3"), "qwen2-longrope": ("qwen2", "longrope"),
    "qwen3-yarn": ("qwen3", "yarn-mscale"), "qwen3-dynamic": ("qwen3", "dynamic"),
    "llada-llama3": ("llada", "llama3"), "llada-yarn": ("llada", "yarn"),
}


@pytest.fixture(scope="module")
def toks():
    return np.random.default_rng(0).integers(0, 96, (2, T))


def _case(tmp_path, builder: str, rope_name: str):
    import hf_fixtures as hf

    rope, max_pos = CASES[rope_name]
    if builder == "llada":
        return hf.llada(str(tmp_path), seed=2, rope_scaling=dict(rope), max_positions=max_pos), "bidirectional"
    theta = {"qwen2": 1e4, "qwen3": 1e6}[builder]
    return hf.BUILDERS[builder](str(tmp_path), seed=1, max_position_embeddings=max_pos,
                                rope_parameters={**rope, "rope_theta": theta}), "block_causal"


def _parity(case, kind, toks, **knobs) -> float:
    """max |dlogit| of our forward (the checkpoint loaded with `knobs`) against the torch model's."""
    import hf_fixtures as hf

    ref = hf.torch_logits(case.model, toks, kind)
    m = mj.load_pretrained(case.path, dtype="float32", **knobs)
    got = np.asarray(mj.forward(mj.Model(m.config.replace(block_size=hf.BLOCK), m.params), toks, attention=kind))
    plain = mj.load_pretrained(case.path, dtype="float32").config.replace(block_size=hf.BLOCK, rope_scaling=None)
    plain = np.asarray(mj.forward(mj.Model(plain, m.params), toks, attention=kind))
    assert np.abs(plain - ref).max() > 0.1  # the RoPE change matters at these positions
    return float(np.abs(got - ref).max())


@needs_torch
@pytest.mark.parametrize("name", list(PARITY))
def test_logits_match_transformers_past_the_original_length(tmp_path, toks, name):
    case, kind = _case(tmp_path, *PARITY[name])
    diff = _parity(case, kind, toks)
    print(f"rope parity {name}: max |dlogit| {diff:.2e}")  # the measured numbers, with -s
    assert diff <= FP32_TOL, diff


@needs_torch
def test_v4_rope_scaling_key_in_config_json(tmp_path, toks):
    """A transformers-v4 config.json (`rope_scaling` with `type`, top-level rope_theta) reads the same."""
    case, kind = _case(tmp_path, "qwen2", "yarn")
    path = os.path.join(case.path, "config.json")
    with open(path) as f:
        c = json.load(f)
    rp = c.pop("rope_parameters")
    c["rope_theta"] = rp.pop("rope_theta")
    c["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in rp.items()}
    with open(path, "w") as f:
        json.dump(c, f)
    diff = _parity(case, kind, toks)
    print(f"rope parity qwen2-yarn (v4 rope_scaling): max |dlogit| {diff:.2e}")
    assert diff <= FP32_TOL, diff


@needs_torch
@pytest.mark.parametrize("knobs, hf_rope", [
    (dict(rope_scaling="yarn:4"), {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG}),
    (dict(rope_scaling="dynamic:2"), {"rope_type": "dynamic", "factor": 2.0}),
    (dict(rope_theta=4e4), {"rope_type": "default"}),
], ids=["yarn", "dynamic", "theta"])
def test_knobs_match_transformers_with_the_same_rope(tmp_path, toks, knobs, hf_rope):
    """A plain checkpoint loaded with a knob = transformers' model with that RoPE in its config."""
    import hf_fixtures as hf
    from transformers import Qwen2ForCausalLM

    case = hf.qwen2(str(tmp_path), seed=4, max_position_embeddings=ORIG)
    cfg = case.model.config
    cfg.rope_parameters = {**hf_rope, "rope_theta": knobs.get("rope_theta", 1e4)}
    scaled = Qwen2ForCausalLM(cfg).eval()
    scaled.load_state_dict(case.model.state_dict())
    diff = _parity(hf.Case("scaled", scaled, case.path), "block_causal", toks, **knobs)
    print(f"rope parity knob {knobs}: max |dlogit| {diff:.2e}")
    assert diff <= FP32_TOL, diff


def test_export_writes_the_scaling_back():
    """A testbed export's config.json carries the model's RoPE scaling and reads back the same."""
    from experiments.testbed.export import hf_config

    base = mj.load_pretrained(TESTBED).config
    for s in (RopeScaling("yarn", 4.0, 8192, mscale=0.8, mscale_all_dim=1.0, beta_fast=16.0),
              RopeScaling("llama3", 8.0, 8192, low_freq_factor=2.0, high_freq_factor=8.0),
              RopeScaling("dynamic", 2.0, 8192), RopeScaling("linear", 2.0)):
        cfg = base.replace(rope_scaling=s, max_position_embeddings=max(8192, s.extended_length))
        assert model_config_from_hf(json.loads(json.dumps(hf_config(cfg)))) == cfg


def test_committed_long_context_exports_load_with_the_scaling_they_were_trained_under():
    """The issue 53 exports kept in experiments/testbed/exports read back as trained: stage 32
    with plain RoPE, stages 34 and 35 and the long twin with Dynamic-YaRN x16 over 2048 from their
    `maskahead_rope_scaling`."""
    root = os.path.join(os.path.dirname(TESTBED), "..", "experiments", "testbed", "exports")
    plain = mj.load_pretrained(os.path.join(root, "stage32")).config
    assert plain.rope_scaling is None and plain.max_position_embeddings >= 32768
    for name in ("stage34_step234", "stage35_step790", "twin_long_step665"):
        dyn = mj.load_pretrained(os.path.join(root, name)).config
        assert dyn.rope_scaling == RopeScaling("dynamic_yarn", 16.0, 2048) and dyn.max_position_embeddings == 33280
        assert dyn.attention == ("bidirectional" if name.startswith("twin") else "block_causal")
