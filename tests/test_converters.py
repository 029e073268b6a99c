"""Converters: key maps against the real checkpoints' names and shapes, every file format
(safetensors, sharded safetensors with index, torch .bin), tied embeddings, the orbax round trip
through `convert` / `load_pretrained`, and clear errors for bad checkpoints."""
from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hf_fixtures as hf  # noqa: E402
import maskahead_jax as mj  # noqa: E402
from converters import CheckpointError, build_plan, cli_convert, is_converted, open_tensors  # noqa: E402
from converters.hf_config import model_config_from_hf  # noqa: E402
from maskahead_jax.model import param_shapes  # noqa: E402

# ------------------------------------------------------------------ key maps (no weights needed)

FAST_DLLM_7B = {"model_type": "Fast_dLLM_Qwen", "hidden_size": 3584, "num_hidden_layers": 28,
                "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
                "vocab_size": 152064, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False}
SDAR_8B = {"model_type": "sdar", "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936,
           "tie_word_embeddings": False}
LLADA_8B = {"model_type": "llada", "d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 32,
            "mlp_hidden_size": 12288, "embedding_size": 126464, "vocab_size": 126464, "block_type": "llama",
            "include_qkv_bias": False, "weight_tying": False, "rope_theta": 500000.0}
LLADA2_MINI = {"model_type": "llada2_moe", "hidden_size": 2048, "num_hidden_layers": 20,
               "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 157184,
               "intermediate_size": 5120, "moe_intermediate_size": 512, "num_experts": 256,
               "num_experts_per_tok": 8, "num_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 8,
               "topk_group": 4, "routed_scaling_factor": 2.5, "partial_rotary_factor": 0.5,
               "use_qkv_bias": False, "use_qk_norm": True, "tie_word_embeddings": False}


def _hf_shapes(hf_cfg: dict) -> dict:
    plan, _ = build_plan(model_config_from_hf(hf_cfg))
    return {k: e.hf_shape for k, e in plan.items()}


def test_plan_fast_dllm_v2_7b():
    s = _hf_shapes(FAST_DLLM_7B)
    assert len(s) == 3 + 28 * 12
    assert s["model.layers.27.self_attn.q_proj.weight"] == (3584, 3584)
    assert s["model.layers.0.self_attn.k_proj.bias"] == (512,)
    assert s["model.layers.3.mlp.down_proj.weight"] == (3584, 18944)
    assert s["lm_head.weight"] == (152064, 3584)


def test_plan_sdar_8b():
    s = _hf_shapes(SDAR_8B)
    assert len(s) == 3 + 36 * 11
    assert s["model.layers.0.self_attn.q_norm.weight"] == (128,)
    assert s["model.layers.0.self_attn.k_proj.weight"] == (1024, 4096)
    assert "model.layers.0.self_attn.q_proj.bias" not in s


def test_plan_llada_8b():
    s = _hf_shapes(LLADA_8B)
    assert len(s) == 3 + 32 * 9
    assert s["model.transformer.blocks.31.ff_proj.weight"] == (12288, 4096)
    assert s["model.transformer.blocks.0.ff_out.weight"] == (4096, 12288)
    assert s["model.transformer.ff_out.weight"] == (126464, 4096)  # the LM head, not an MLP
    assert s["model.transformer.wte.weight"] == (126464, 4096)


def test_plan_llada2_mini_covers_every_slot_once():
    cfg = model_config_from_hf(LLADA2_MINI)
    plan, _ = build_plan(cfg)
    s = {k: e.hf_shape for k, e in plan.items()}
    assert len(s) == 3 + 9 + 19 * (6 + 2 + 256 * 3 + 3)
    assert s["model.layers.1.attention.query_key_value.weight"] == (3072, 2048)
    assert s["model.layers.0.mlp.gate_proj.weight"] == (5120, 2048)
    assert s["model.layers.19.mlp.gate.weight"] == (256, 2048)
    assert s["model.layers.19.mlp.gate.expert_bias"] == (256,)
    assert s["model.layers.5.mlp.experts.255.down_proj.weight"] == (2048, 512)
    assert s["model.layers.5.mlp.shared_experts.up_proj.weight"] == (512, 2048)
    assert "model.layers.1.mlp.gate_proj.weight" not in s and "model.layers.0.mlp.gate.weight" not in s
    seen: dict[tuple, set] = {}
    for e in plan.values():
        for slot in e.slots:
            assert slot.index not in seen.setdefault(slot.path, set())
            seen[slot.path].add(slot.index)
    leaves = jax.tree_util.tree_flatten_with_path(param_shapes(cfg),
                                                  is_leaf=lambda x: isinstance(x, tuple))[0]
    for kp, shape in leaves:
        path = tuple(p.key for p in kp)
        lead = 2 if path[:3] == ("moe_layers", "moe", "experts") else (1 if path[0].endswith("layers") else 0)
        assert len(seen[path]) == int(np.prod(shape[:lead])), path


def test_fused_qkv_split_by_heads():
    """LLaDA2's fused rows are [Q heads | K heads | V heads], each head Dh rows."""
    from converters.keymaps import convert_tensor

    cfg = model_config_from_hf({**LLADA2_MINI, "hidden_size": 6, "num_attention_heads": 2,
                                "num_key_value_heads": 1, "head_dim": 4, "num_hidden_layers": 1,
                                "num_experts": 0, "use_qkv_bias": True})
    plan, _ = build_plan(cfg)
    bq, bk, bv = convert_tensor(plan["model.layers.0.attention.query_key_value.bias"], np.arange(16.0))
    assert (bq.shape, bk.shape, bv.shape) == ((2, 4), (1, 4), (1, 4))
    assert (bq[1, 0], bk[0, 0], bv[0, 3]) == (4.0, 8.0, 15.0)
    e = plan["model.layers.0.attention.query_key_value.weight"]
    assert e.hf_shape == (16, 6)
    x = np.arange(16 * 6, dtype=np.float32).reshape(16, 6)
    wq, wk, wv = convert_tensor(e, x)
    assert (wq.shape, wk.shape, wv.shape) == ((6, 2, 4), (6, 1, 4), (6, 1, 4))
    np.testing.assert_array_equal(wq[:, 1, 2], x[6])  # head 1, dim 2 -> row 1 * 4 + 2
    np.testing.assert_array_equal(wk[:, 0, 0], x[8])
    np.testing.assert_array_equal(wv[:, 0, 3], x[15])


# ------------------------------------------------------------------ file formats + parity


def _assert_parity(case, kind="bidirectional", tol=1e-4):
    toks = np.random.default_rng(3).integers(0, hf.VOCAB, (1, 8))
    m = mj.load_pretrained(case.path, dtype="float32")
    m = mj.Model(m.config.replace(block_size=hf.BLOCK), m.params)
    got = np.asarray(mj.forward(m, toks, attention=kind))
    assert np.abs(got - hf.torch_logits(case.model, toks, kind)).max() <= tol
    return m


def test_torch_bin_checkpoint(tmp_path):
    case = hf.llada(str(tmp_path), seed=11, fmt="bin")
    assert os.listdir(tmp_path) and "pytorch_model.bin" in os.listdir(tmp_path)
    _assert_parity(case, "block_causal")


def test_sharded_safetensors_with_index(tmp_path):
    case = hf.llada2(str(tmp_path / "m"), seed=12, fmt="sharded", num_hidden_layers=2)
    assert len({r.file for r in open_tensors(case.path).values()}) == 2
    _assert_parity(case)
    os.remove(os.path.join(case.path, "model-00002-of-00002.safetensors"))
    with pytest.raises(CheckpointError, match=r"lists shard\(s\) not in .*model-00002-of-00002"):
        mj.load_pretrained(case.path)


def test_tied_embeddings_without_lm_head(tmp_path):
    case = hf.qwen2(str(tmp_path), seed=13, tie=True)
    assert "lm_head.weight" not in open_tensors(case.path)
    m = _assert_parity(case)
    assert m.config.tie_embeddings and "lm_head" not in m.params


def test_tied_embeddings_with_a_stored_head_copy(tmp_path):
    case = hf.qwen2(str(tmp_path / "src"), seed=13, tie=True)
    sd = dict(case.model.state_dict())
    assert "lm_head.weight" in sd
    with open(os.path.join(case.path, "config.json")) as f:
        cfg = json.load(f)
    hf.write_checkpoint(str(tmp_path / "dst"), sd, cfg)
    assert "lm_head" not in mj.load_pretrained(str(tmp_path / "dst")).params


def test_dtype_none_keeps_checkpoint_dtype(tmp_path):
    case = hf.qwen3(str(tmp_path / "src"), seed=14)
    sd = {k: v.to(torch.bfloat16) for k, v in case.model.state_dict().items()}
    with open(os.path.join(case.path, "config.json")) as f:
        cfg = json.load(f)
    hf.write_checkpoint(str(tmp_path / "bf16"), sd, cfg)
    m = mj.load_pretrained(str(tmp_path / "bf16"))
    assert {str(a.dtype) for a in jax.tree_util.tree_leaves(m.params)} == {"bfloat16"}
    want = sd["model.layers.1.self_attn.q_proj.weight"].float().numpy().T.reshape(32, 4, 8)
    np.testing.assert_array_equal(np.asarray(m.params["layers"]["wq"][1], np.float32), want)


def test_orbax_round_trip_via_convert_cli(tmp_path, capsys):
    case = hf.qwen3(str(tmp_path / "hf"), seed=15)
    dst = str(tmp_path / "converted")
    assert cli_convert([case.path, dst, "--dtype", "bfloat16"]) == 0
    assert is_converted(dst)
    files = os.listdir(dst)
    assert "config.json" in files and "generation_config.json" in files
    assert not [f for f in files if f.endswith(".safetensors")]
    a = mj.load_pretrained(dst)
    b = mj.load_pretrained(case.path, dtype="bfloat16")
    assert a.config == b.config
    for x, y in zip(jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    assert jax.tree_util.tree_structure(a.params) == jax.tree_util.tree_structure(b.params)
    toks = np.arange(8)[None] % hf.VOCAB
    np.testing.assert_array_equal(np.asarray(mj.forward(a, toks)), np.asarray(mj.forward(b, toks)))
    f32 = mj.load_pretrained(dst, dtype="float32")
    assert {str(l.dtype) for l in jax.tree_util.tree_leaves(f32.params)} == {"float32"}
    # an existing destination is refused unless --force
    assert cli_convert([case.path, dst]) == 2
    assert "not empty" in capsys.readouterr().err
    assert cli_convert([case.path, dst, "--force"]) == 0
    assert mj.load_pretrained(dst).params["embed"].dtype == np.float32


# ------------------------------------------------------------------ bad checkpoints


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A valid tiny Qwen3 checkpoint: (state dict, config.json dict)."""
    case = hf.qwen3(str(tmp_path_factory.mktemp("good")), seed=16)
    with open(os.path.join(case.path, "config.json")) as f:
        cfg = json.load(f)
    return dict(case.model.state_dict()), cfg


def _write(tmp_path, good, drop=(), add=None, config=None) -> str:
    sd, cfg = good
    sd = {k: v for k, v in sd.items() if k not in drop}
    sd.update(add or {})
    return hf.write_checkpoint(str(tmp_path / "ckpt"), sd, {**cfg, **(config or {})})


def test_missing_key(tmp_path, good):
    path = _write(tmp_path, good, drop=["model.layers.1.mlp.up_proj.weight"])
    with pytest.raises(CheckpointError, match=r"missing key.*model\.layers\.1\.mlp\.up_proj\.weight "
                                              r"\(expected shape \(48, 32\)\)"):
        mj.load_pretrained(path)


def test_missing_lm_head_when_untied(tmp_path, good):
    path = _write(tmp_path, good, drop=["lm_head.weight"])
    with pytest.raises(CheckpointError, match=r"missing key.*lm_head\.weight \(expected shape \(96, 32\)\)"):
        mj.load_pretrained(path)


def test_extra_key(tmp_path, good):
    path = _write(tmp_path, good, add={"model.layers.0.self_attn.q_proj.bias": torch.zeros(32)})
    with pytest.raises(CheckpointError, match=r"unexpected key.*model\.layers\.0\.self_attn\.q_proj\.bias"):
        mj.load_pretrained(path)


def test_extra_layer(tmp_path, good):
    path = _write(tmp_path, good, add={"model.layers.2.input_layernorm.weight": torch.ones(32)})
    with pytest.raises(CheckpointError, match=r"unexpected key.*model\.layers\.2\.input_layernorm\.weight"):
        mj.load_pretrained(path)


def test_wrong_shape(tmp_path, good):
    path = _write(tmp_path, good, add={"model.layers.0.self_attn.k_proj.weight": torch.zeros(8, 32)})
    with pytest.raises(CheckpointError, match=r"wrong shape for model\.layers\.0\.self_attn\.k_proj\.weight "
                                              r"in model\.safetensors: expected \(16, 32\), found \(8, 32\)"):
        mj.load_pretrained(path)


def test_unknown_model_type(tmp_path, good):
    path = _write(tmp_path, good, config={"model_type": "gpt_neox"})
    with pytest.raises(CheckpointError, match=r"config\.json: unknown model_type 'gpt_neox'"):
        mj.load_pretrained(path)


@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_corrupt_safetensors(tmp_path, good, damage):
    path = _write(tmp_path, good)
    f = os.path.join(path, "model.safetensors")
    data = open(f, "rb").read()
    data = data[: len(data) // 2] if damage == "truncate" else data[:8] + b"{not json" + data[17:]
    with open(f, "wb") as fh:
        fh.write(data)
    with pytest.raises(CheckpointError, match=r"corrupt safetensors file model\.safetensors"):
        mj.load_pretrained(path)


def test_missing_config_and_weights(tmp_path, good):
    path = _write(tmp_path, good)
    os.remove(os.path.join(path, "config.json"))
    with pytest.raises(CheckpointError, match=r"has no config\.json"):
        mj.load_pretrained(path)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(good[1]))
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors or pytorch_model\*\.bin weights"):
        mj.load_pretrained(str(empty))
    with pytest.raises(FileNotFoundError, match="no such checkpoint folder"):
        mj.load_pretrained(str(tmp_path / "nowhere"))
    assert issubclass(CheckpointError, ValueError)


def test_cli_reports_errors(tmp_path, good, capsys):
    path = _write(tmp_path, good, drop=["model.norm.weight"])
    assert cli_convert([path, str(tmp_path / "out")]) == 2
    assert "missing key" in capsys.readouterr().err and not os.path.exists(tmp_path / "out")


# ------------------------------------------------------------------ convert never loses a folder


def _tree(path) -> dict:
    """{relative path: bytes} of every file under `path`."""
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            full = os.path.join(root, f)
            out[os.path.relpath(full, path)] = open(full, "rb").read()
    return out


def _stray(parent) -> list:
    """Temporary folders `convert` left beside its destination."""
    return [f for f in os.listdir(parent) if ".tmp-" in f or ".old-" in f]


@pytest.mark.parametrize("bad", ["missing", "corrupt"])
def test_convert_force_with_bad_source_keeps_destination(tmp_path, good, bad, capsys):
    """--force must not delete DST before SRC has converted: a typo'd or corrupt SRC leaves it whole."""
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "notes.txt").write_text("precious")
    marker = json.dumps({"format": "maskahead-orbax"})  # a folder convert wrote: --force may replace it
    (dst / "maskahead.json").write_text(marker)
    src = str(tmp_path / "nowhere")
    if bad == "corrupt":
        src = _write(tmp_path, good)
        f = os.path.join(src, "model.safetensors")
        data = open(f, "rb").read()
        open(f, "wb").write(data[: len(data) // 2])
    before = _tree(src) if bad == "corrupt" else None
    assert cli_convert([src, str(dst), "--force"]) == 2
    assert "maskahead convert: error" in capsys.readouterr().err
    assert _tree(dst) == {"notes.txt": b"precious", "maskahead.json": marker.encode()}
    if before is not None:
        assert _tree(src) == before
    assert _stray(tmp_path) == []


def test_convert_failed_write_keeps_destination(tmp_path, good, monkeypatch):
    """A failure while writing (here: the orbax save) removes the temp folder and keeps DST."""
    import converters.load as L

    src = _write(tmp_path, good)
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "notes.txt").write_text("precious")
    (dst / "maskahead.json").write_text('{"format": "maskahead-orbax"}')  # convert's marker: --force may replace

    def broken_save(params, path):
        os.makedirs(path)
        raise OSError("disk full")

    monkeypatch.setattr(L, "save_orbax", broken_save)
    with pytest.raises(OSError, match="disk full"):
        L.convert(src, str(dst), overwrite=True, progress=False)
    assert _tree(dst) == {"notes.txt": b"precious", "maskahead.json": b'{"format": "maskahead-orbax"}'}
    assert _stray(tmp_path) == []


def test_convert_refuses_source_as_destination(tmp_path, good, capsys):
    src = _write(tmp_path, good)
    before = _tree(src)
    os.symlink(src, tmp_path / "alias")
    for dst in (src, src + "/", str(tmp_path / "alias")):
        assert cli_convert([src, dst, "--force"]) == 2
        err = capsys.readouterr().err
        assert "is the source folder" in err and len(err.strip().splitlines()) == 1
    assert _tree(src) == before
    assert mj.load_pretrained(src).config.num_layers == 2


def test_convert_refuses_nested_folders(tmp_path, good, capsys):
    src = _write(tmp_path, good)
    before = _tree(src)
    assert cli_convert([src, os.path.join(src, "out"), "--force"]) == 2
    assert "lies inside the source folder" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(src, "out"))
    assert cli_convert([src, str(tmp_path), "--force"]) == 2  # deleting DST would delete SRC
    assert "lies inside the destination folder" in capsys.readouterr().err
    assert _tree(src) == before


def test_convert_force_refuses_a_folder_convert_did_not_write(tmp_path, good, capsys):
    """Issue 50: --force replaces only an empty folder or one `convert` wrote (maskahead.json of
    its format); a folder of user files (or a foreign maskahead.json) is refused, one line, exit
    2, untouched."""
    src = _write(tmp_path, good)
    dst = tmp_path / "thesis"
    (dst / "sub").mkdir(parents=True)
    (dst / "thesis.txt").write_text("chapter 1")
    (dst / "sub" / "data.csv").write_text("a,b\n1,2\n")
    before = _tree(dst)
    for marker in (None, json.dumps({"format": "something-else"}), "{not json"):
        if marker is not None:
            (dst / "maskahead.json").write_text(marker)
            before = _tree(dst)
        assert cli_convert([src, str(dst), "--force"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"maskahead convert: error: destination {dst} is not a folder "
                                                   "`maskahead convert` wrote")
        assert _tree(dst) == before and _stray(tmp_path) == []
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli_convert([src, str(empty), "--force"]) == 0 and is_converted(str(empty))


def test_convert_force_replaces_destination_atomically(tmp_path, good):
    src = _write(tmp_path, good)
    dst = tmp_path / "dst"
    assert cli_convert([src, str(dst)]) == 0  # a folder convert wrote (maskahead.json) ...
    (dst / "stale.txt").write_text("old")  # ... with a file added since
    assert cli_convert([src, str(dst), "--force"]) == 0
    assert is_converted(str(dst)) and not (dst / "stale.txt").exists()
    assert _stray(tmp_path) == []
    assert mj.load_pretrained(str(dst)).config == mj.load_pretrained(src).config


class _RunsCode:
    """Unpickling this makes a folder: the sign that code from a checkpoint ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_torch_pickle_with_code_is_refused_without_weights_only_advice(tmp_path, good):
    """torch's refusal says to retry with weights_only=False (which would run the file's code);
    ours must not, and must point at safetensors instead."""
    sd, cfg = good
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    marker = str(tmp_path / "code_ran")
    torch.save({**sd, "evil": _RunsCode(marker)}, str(path / "pytorch_model.bin"))
    with pytest.raises(CheckpointError) as e:
        mj.load_pretrained(str(path))
    msg = str(e.value)
    assert "pytorch_model.bin" in msg and "safetensors" in msg
    assert "weights_only" not in msg
    assert not os.path.exists(marker)


# ------------------------------------------------------------------ configs that would run as garbage

QWEN25_7B_INSTRUCT = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
                      "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                      "intermediate_size": 18944, "vocab_size": 152064, "rope_theta": 1e6,
                      "tie_word_embeddings": False, "eos_token_id": 151645}


@pytest.mark.parametrize("mask_id", [152064, 200000, -1])
def test_mask_token_id_outside_vocab_is_an_error(mask_id):
    with pytest.raises(ValueError, match=rf"mask_token_id={mask_id} .*vocab_size=152064"):
        model_config_from_hf({**FAST_DLLM_7B, "mask_token_id": mask_id})
    with pytest.raises(ValueError, match="mask_token_id"):
        model_config_from_hf(FAST_DLLM_7B).replace(mask_token_id=mask_id)


def test_mask_token_id_outside_vocab_in_hf_and_converted_folders(tmp_path, good):
    path = _write(tmp_path, good, config={"mask_token_id": hf.VOCAB})
    with pytest.raises(CheckpointError, match=rf"config\.json: mask_token_id={hf.VOCAB} .*vocab_size={hf.VOCAB}"):
        mj.load_pretrained(path)
    path = _write(tmp_path, good)
    dst = str(tmp_path / "converted")
    assert cli_convert([path, dst]) == 0
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**cfg, "mask_token_id": 1000}, f)
    with pytest.raises(CheckpointError, match=r"mask_token_id=1000 .*vocab_size=96"):
        mj.load_pretrained(dst)


def test_plain_autoregressive_config_is_refused_unless_a_family_is_forced():
    with pytest.raises(ValueError, match=r"Qwen2ForCausalLM is a plain autoregressive model, not a diffusion "
                                         r"LM.*family='fast_dllm_v2'.*--family fast_dllm_v2"):
        model_config_from_hf(QWEN25_7B_INSTRUCT)
    qwen3 = {**SDAR_8B, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    with pytest.raises(ValueError, match=r"Qwen3ForCausalLM is a plain autoregressive.*--family sdar"):
        model_config_from_hf(qwen3)
    forced = model_config_from_hf(QWEN25_7B_INSTRUCT, family="fast_dllm_v2")
    assert (forced.family, forced.logits_shift, forced.mask_token_id) == ("fast_dllm_v2", True, 151665)
    assert model_config_from_hf(qwen3, family="sdar").family == "sdar"
    with pytest.raises(ValueError, match="unknown family 'gpt'"):
        model_config_from_hf(QWEN25_7B_INSTRUCT, family="gpt")
    # what the real diffusion checkpoints carry: Fast-dLLM v2's architecture name / bd_size, SDAR's block_size
    for marker in ({"architectures": ["Fast_dLLM_QwenForCausalLM"]}, {"bd_size": 32}, {"mask_token_id": 151665}):
        assert model_config_from_hf({**QWEN25_7B_INSTRUCT, **marker}).family == "fast_dllm_v2"
    assert model_config_from_hf({**qwen3, "block_size": 4}).family == "sdar"


def test_plain_qwen2_folder_refused_then_forced(tmp_path, capsys):
    """A Qwen2ForCausalLM folder as transformers saves it: refused by load_pretrained, convert and
    the CLI with the way out named; --family / family= run it (logits match torch's)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from maskahead_jax import cli

    cfg = Qwen2Config(vocab_size=151936, hidden_size=hf.HIDDEN, intermediate_size=hf.FFN, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = hf.randomize_(Qwen2ForCausalLM(cfg), 21)
    model.tie_weights()
    path = str(tmp_path / "qwen2")
    model.save_pretrained(path)
    with pytest.raises(CheckpointError, match="plain autoregressive model, not a diffusion LM"):
        mj.load_pretrained(path)
    assert cli.main(["generate", "--model", path, "--ids", "5,6"]) == 2
    assert "--family fast_dllm_v2" in capsys.readouterr().err
    dst = str(tmp_path / "converted")
    assert cli_convert([path, dst]) == 2
    assert "--family fast_dllm_v2" in capsys.readouterr().err
    assert cli_convert([path, dst, "--family", "fast_dllm_v2"]) == 0
    for m in (mj.load_pretrained(path, family="fast_dllm_v2"), mj.load_pretrained(dst)):  # dst: maskahead.json
        assert m.config.family == "fast_dllm_v2"
        toks = np.random.default_rng(4).integers(0, 151936, (1, 8))
        m = mj.Model(m.config.replace(block_size=hf.BLOCK), m.params)
        got = np.asarray(mj.forward(m, toks, attention="block_causal"))
        assert np.abs(got - hf.torch_logits(model, toks, "block_causal")).max() <= 1e-4


# ------------------------------------------------------------------ "Dream": Dream-v0 or DreamReasoner


def _as_dream_config(case, drop=("attention_bias", "use_qk_norm", "qk_norm")) -> dict:
    """Rewrite a saved tiny folder's config.json as a "Dream" one with no q/k-norm flag (and, by
    default, no Qwen3 `attention_bias` either): the ambiguous case of issue 37."""
    path = os.path.join(case.path, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg = {k: v for k, v in cfg.items() if k not in drop}
    cfg.update(model_type="Dream", architectures=["DreamModel"])
    with open(path, "w") as f:
        json.dump(cfg, f)
    return cfg


@pytest.mark.parametrize("fmt", ["safetensors", "sharded"])
def test_dream_reasoner_folder_is_told_apart_by_its_key_names(tmp_path, fmt):
    """Qwen3 weights (q_norm / k_norm, no bias) under a "Dream" config.json without a q/k-norm
    flag: read as DreamReasoner from the safetensors headers (or the shard index), loads, and its
    logits match the torch model's."""
    from converters.hf_config import checkpoint_keys, dream_variant, model_config_from_file

    case = hf.qwen3(str(tmp_path / "src"), seed=31)
    if fmt == "sharded":
        sd = dict(case.model.state_dict())
        with open(os.path.join(case.path, "config.json")) as f:
            hf.write_checkpoint(str(tmp_path / "m"), sd, json.load(f), fmt="sharded")
        case = hf.Case("qwen3", case.model, str(tmp_path / "m"))
    cfg = _as_dream_config(case)
    keys = checkpoint_keys(case.path)
    assert "model.layers.0.self_attn.q_norm.weight" in keys and not any(k.endswith(".bias") for k in keys)
    assert dream_variant(cfg) == "dream"  # the config alone says nothing: Dream-v0, as before
    assert dream_variant(cfg, keys) == "dream_reasoner"
    for c in (model_config_from_file(case.path), mj.load_pretrained(case.path).config):
        assert (c.family, c.layout, c.qk_norm, c.qkv_bias) == ("dream_reasoner", "qwen3", True, False)
        assert (c.attention, c.logits_shift, c.commit_rule) == ("block_causal", False, "dream_reasoner")
    _assert_parity(case, "block_causal")


def test_dream_v0_folder_stays_dream_v0(tmp_path):
    """Qwen2 weights (q/k/v bias, no q/k norm) under the same kind of "Dream" config.json."""
    from converters.hf_config import checkpoint_keys, dream_variant

    case = hf.qwen2(str(tmp_path / "m"), seed=32)
    cfg = _as_dream_config(case)
    assert dream_variant(cfg, checkpoint_keys(case.path)) == "dream"
    m = _assert_parity(case, "bidirectional")
    c = m.config
    assert (c.family, c.layout, c.qk_norm, c.qkv_bias) == ("dream", "qwen2", False, True)
    assert (c.attention, c.logits_shift, c.commit_rule) == ("bidirectional", True, "llada")


def test_dream_variant_order_of_evidence():
    """Explicit flag > the checkpoint's key names > Qwen3's attention_bias: false > Dream-v0."""
    from converters.hf_config import dream_variant

    base = {"model_type": "Dream", "hidden_size": 64, "num_attention_heads": 4}
    norm_keys = ["model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"]
    bias_keys = ["model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.q_proj.weight"]
    assert dream_variant({**base, "use_qk_norm": True}, bias_keys) == "dream_reasoner"
    assert dream_variant({**base, "use_qk_norm": False}, norm_keys) == "dream"
    assert dream_variant(base, norm_keys) == "dream_reasoner"
    assert dream_variant({**base, "attention_bias": False}, bias_keys) == "dream"
    assert dream_variant({**base, "attention_bias": False}) == "dream_reasoner"
    assert dream_variant(base, None) == dream_variant(base, lambda: None) == "dream"
    calls = []
    dream_variant({**base, "qk_norm": True}, lambda: calls.append(1) or norm_keys)
    assert calls == []  # the names are read only when the config leaves the question open
    qwen3_like = {**SDAR_8B, "model_type": "Dream", "attention_bias": False}
    c = model_config_from_hf(qwen3_like)
    assert (c.family, c.layout, c.qk_norm, c.qkv_bias) == ("dream_reasoner", "qwen3", True, False)
    c = model_config_from_hf({**FAST_DLLM_7B, "model_type": "Dream"})
    assert (c.family, c.layout, c.qkv_bias) == ("dream", "qwen2", True)
