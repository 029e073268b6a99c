"""Issue 50, API input checks: one validation path for GenerationConfig whatever the entry
(Python, the CLI's flags, a model's config.json defaults), prompts that are not token-id lists,
and `forward` refusing the out-of-vocabulary ids `generate` refuses. Each check runs before any
forward (no compile): the whole file takes a second or two."""
import dataclasses
import json
import os

import numpy as np
import pytest

import maskahead_jax as mj
from maskahead_jax import cli
from maskahead_jax.config import ConfigError, GenerationConfig
from tiny import tiny_model


@pytest.mark.parametrize("kw, msg", [
    (dict(threshold=5.0), "threshold must be a commit threshold in (0, 1], got 5.0"),
    (dict(threshold=0.0), "threshold must be a commit threshold in (0, 1], got 0.0"),
    (dict(threshold=float("nan")), "threshold must be a commit threshold in (0, 1], got nan"),
    (dict(block_size=-32), "block_size must be a positive integer, got -32"),
    (dict(block_size=0), "block_size must be a positive integer, got 0"),
    (dict(max_new_tokens=16.5), "max_new_tokens must be a positive integer, got 16.5"),
    (dict(max_new_tokens=0), "max_new_tokens must be a positive integer, got 0"),
    (dict(max_new_tokens=True), "max_new_tokens must be a positive integer, got True"),
    (dict(commit_rule="greedy"), "commit_rule must be one of fast_dllm, dynamic, dream_reasoner, llada"),
    (dict(prefill_chunk=0), "prefill_chunk must be a positive integer, got 0"),
    (dict(block_size=32, prefill_chunk=100), "prefill_chunk 100 must be a positive multiple of block_size 32"),
    (dict(temperature=-1.0), "temperature must be a finite number >= 0, got -1.0"),
    (dict(top_p=0.0), "top_p must be a number in (0, 1], got 0.0"),
    (dict(steps_per_block=-1), "steps_per_block must be a positive integer"),
    (dict(prompt_refresh=-1), "prompt_refresh must be an integer >= 0"),
])
def test_generation_config_refuses_bad_values_at_construction(kw, msg):
    with pytest.raises(ConfigError) as ex:
        GenerationConfig(**kw)
    assert str(ex.value) == f"GenerationConfig: {msg}" or msg in str(ex.value)
    assert isinstance(ex.value, ValueError)


def test_generation_config_accepts_numpy_values_and_checks_replace():
    g = GenerationConfig(max_new_tokens=np.int64(8), threshold=np.float32(0.5), block_size=None)
    assert g.max_new_tokens == 8 and g.resolve(tiny_model("sdar").config).threshold == 0.5
    with pytest.raises(ConfigError, match="threshold must be"):  # replace() goes through the same check
        dataclasses.replace(g, threshold=2)


def test_config_json_decoding_defaults_share_the_check(tmp_path, capsys):
    """config.json's threshold / block_size (the model's decoding defaults) go through the same
    check: one line naming the field, before anything is loaded."""
    src = cli.TESTBED
    for field, value, msg in [("threshold", 5, "threshold must be a"), ("block_size", -32, "block_size must be a")]:
        dst = tmp_path / field
        dst.mkdir()
        for f in ("tokenizer.json", "model.safetensors"):
            os.symlink(os.path.join(src, f), dst / f)
        cfg = json.load(open(os.path.join(src, "config.json")))
        cfg[field] = value
        (dst / "config.json").write_text(json.dumps(cfg))
        assert cli.main(["generate", "--model", str(dst), "--ids", "5,6"]) == 2
        err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert len(err) == 1 and err[0].startswith("maskahead generate: error: cannot load") and msg in err[0], err
        assert err[0].endswith(f"got {value}") or f"got {value}." in err[0], err
        with pytest.raises(ValueError, match=msg):
            mj.load_pretrained(str(dst))
    # a ModelConfig built in Python: the same check as GenerationConfig's
    with pytest.raises(ConfigError, match=r"model config: threshold must be a commit threshold in \(0, 1\], got 5"):
        tiny_model("sdar").config.replace(threshold=5)


def test_cli_flags_use_the_same_check(capsys):
    with pytest.raises(SystemExit) as ex:
        cli.main(["generate", "--ids", "5", "--threshold", "5"])
    assert ex.value.code == 2
    assert "a commit threshold in (0, 1], got 5" in capsys.readouterr().err


@pytest.fixture(scope="module")
def model():
    return tiny_model("sdar")


@pytest.mark.parametrize("prompts, kind, msg", [
    (["hello"], TypeError, "prompt 0 is text ('hello'): encode it first"),
    ("hello", TypeError, "got str: encode the text first"),
    ([5, 6, 7], TypeError, "got a flat list of ids: wrap one prompt as [ids]"),
    (np.array([5, 6, 7]), ValueError, "got a 1-D array: wrap one prompt as [ids]"),
    ([[5, 6.5]], TypeError, "prompt 0 holds 6.5 (float), not an integer token id"),
    ([[5, None]], TypeError, "prompt 0 holds None (NoneType), not an integer token id"),
    ([[5, True]], TypeError, "prompt 0 holds True (bool)"),
    (np.array([[1.0, 2.0]]), TypeError, "got an array of float64"),
    ([], ValueError, "non-empty list of non-empty token-id lists"),
])
def test_generate_says_prompts_must_be_token_id_lists(model, prompts, kind, msg):
    with pytest.raises(kind) as ex:
        mj.generate(model, prompts, GenerationConfig(max_new_tokens=4))
    assert msg in str(ex.value)
    assert "prompts must be" in str(ex.value)


def test_generate_still_takes_arrays_and_tuples(model):
    from maskahead_jax.engine.generate import _as_id_lists

    assert _as_id_lists(np.array([[1, 2], [3, 4]], np.int32)) == [[1, 2], [3, 4]]
    assert _as_id_lists(([np.int64(1), 2], np.array([3]))) == [[1, 2], [3]]


def test_forward_refuses_out_of_vocabulary_ids(model):
    v = model.config.vocab_size
    with pytest.raises(ValueError, match=rf"outside \[0, {v}\): \[{v}\]"):
        mj.forward(model, [1, 2, v])
    with pytest.raises(ValueError, match=r"outside .*\[-1\]"):
        mj.forward(model, [[1, -1]])
    with pytest.raises(TypeError, match="integer token ids"):
        mj.forward(model, [1.5, 2.0])
    with pytest.raises(ValueError, match="non-empty"):
        mj.forward(model, [])
