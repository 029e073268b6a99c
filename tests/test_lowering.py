"""maskahead_jax/lowering/: generate programs lowered for TPU / CUDA without a device (abstract
params and meshes), and the memory plan's KV accounting against the engine's own stats."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from maskahead_jax import lowering as LW
from maskahead_jax.config import GenerationConfig
from maskahead_jax.generate import generate
from maskahead_jax.policies import make
from maskahead_jax.sharding import abstract_mesh
from tiny import tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ok(row):
    assert row["lowered"], row["error"]
    assert row["error"] is None and row["skipped"] is None
    assert row["kernel_calls"] > 0 and row["stablehlo_chars"] > 0
    return row


def test_auto_attention_resolves_for_the_abstract_meshs_device():
    import jax

    from maskahead_jax.kernels import attention, dispatch

    assert attention.resolve("auto") == "reference"  # this CPU
    with jax.sharding.use_abstract_mesh(LW.abstract_mesh(None, LW.TARGETS["tpu"])):
        assert dispatch.target_backend() == "tpu" and attention.resolve("auto") == "pallas_tpu"
        assert dispatch.resolve_impl(None, packed=True) == "pallas_tpu"
    with jax.sharding.use_abstract_mesh(LW.abstract_mesh("data=2", LW.TARGETS["cuda"])):
        assert attention.resolve("auto") == "pallas_gpu"
        assert dispatch.resolve_impl(None, packed=True) in ("pallas_triton", "reference")  # GPU_PACKED_IMPL rule
    with jax.sharding.use_abstract_mesh(LW.abstract_mesh("data=2")):  # no device named: this machine's
        assert attention.resolve("auto") == "reference"


def test_lowered_for_tpu_and_cuda_on_one_device_with_the_kernels():
    tpu = _ok(LW.lower_case("fast-dllm-v2-7b", "tpu", "dense", 1024))
    assert set(tpu["custom_calls"]) == {"tpu_custom_call"}
    # the packed 2-bit cache on CUDA: Triton for packed contexts, Mosaic GPU for the float ones
    # (the selected entries' buffer), as "auto" picks them on a GPU
    cuda = _ok(LW.lower_case("fast-dllm-v2-7b", "cuda", "q-maskahead[bits=2]", 1024))
    assert any("triton" in t for t in cuda["custom_calls"]) and any("mosaic_gpu" in t for t in cuda["custom_calls"])
    assert cuda["mesh"] is None and cuda["batch"] == 1


def test_a_policy_the_shape_refuses_is_skipped_not_failed():
    row = LW.lower_case("llada-8b", "tpu", "q-maskahead", 1024)
    assert row["skipped"] and "block-causal" in row["skipped"] and not row["lowered"] and row["error"] is None


def test_lowered_on_a_2x2_abstract_mesh():
    """No devices: the mesh is abstract. Rows split over data (batch 2), heads over model."""
    cuda = _ok(LW.lower_case("sdar-8b", "cuda", "dense", 1024, mesh="data=2,model=2"))
    assert cuda["mesh"] == "data=2,model=2" and cuda["batch"] == 2
    tpu = LW.lower_case("sdar-8b", "tpu", "dense", 1024, mesh="data=2,model=2")
    if not tpu["lowered"] and "shard_map" in (tpu["error"] or ""):
        assert "\n" not in tpu["error"]  # one line: the error and where the kernel was traced
        pytest.xfail(f"Mosaic TPU kernels under a mesh need shard_map (issue 52 item 1): {tpu['error']}")
    _ok(tpu)


def test_cli_lowers_7b_at_32k_without_memory_for_its_weights():
    """`maskahead lower --json` in its own process: the 7B program at 32k is lowered from abstract
    shapes, so the process never holds its 15 GB of weights."""
    cmd = [sys.executable, "-m", "maskahead_jax.cli", "lower", "--platform", "tpu", "--shape", "fast-dllm-v2-7b",
           "--prompt-len", "32768", "--policies", "dense", "--json"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    (row,) = json.loads(p.stdout)
    _ok(row)
    assert row["prompt_len"] == 32768 and row["positions"] > row["trained_positions"] == 32768
    peak_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    assert peak_gib < 4, f"lowering held {peak_gib:.1f} GiB"


def _engine_kv(model, policy, n, out_len):
    prompt = [int(5 + (7 * i) % 40) for i in range(n)]
    out = generate(model, [prompt], GenerationConfig(max_new_tokens=out_len, stop_at_eos=False), policy)
    return out.stats["kv_bytes_peak"][0], out.stats["kv_bytes_final"][0]


SMALL = dict(capacity_floor=64, topk_floor=16, sinks=2, recent=32, interval_blocks=2, lookahead_blocks=2)


def test_kv_accounting_equals_the_engines_stats_block_causal():
    """Q-MaskAhead 2-bit: the schedule of every composed policy (prefill, evictions after the
    prompt and every 2 blocks, whole-group budgets) and the packed format's bytes per token.
    (Also checked equal, not run here for time: dense, maskahead, q-maskahead 4-bit.)"""
    model = tiny_model("sdar", head_dim=32, block_size=32)
    policy = make("q-maskahead", 10, bits=2, **SMALL)
    n, out_len = 700, 160
    gen = GenerationConfig(max_new_tokens=out_len, stop_at_eos=False).resolve(model.config)
    acc = LW.kv_accounting(model.config, gen, policy, n, cache_dtype=model.params["embed"].dtype)
    peak, end = _engine_kv(model, policy, n, out_len)
    assert (acc["peak"], acc["end"]) == pytest.approx((peak, end), rel=1e-6)
    assert acc["end"] < 0.5 * acc["peak"]  # evictions happened


def test_kv_accounting_equals_the_engines_stats_maskkv():
    model = tiny_model("llada")
    n, out_len = 300, 32
    gen = GenerationConfig(max_new_tokens=out_len, stop_at_eos=False).resolve(model.config)
    policy = make("maskkv", 10)
    acc = LW.kv_accounting(model.config, gen, policy, n, cache_dtype=model.params["embed"].dtype)
    assert (acc["peak"], acc["end"]) == pytest.approx(_engine_kv(model, policy, n, out_len), rel=1e-6)


def test_plan_rows_without_compiles():
    plan = LW.memory_plan("fast-dllm-v2-7b", (32768,), (1, 8), ("dense", "maskahead"), compile_temps=False)
    rows = {(r["batch"], r["policy"]): r for r in plan["rows"]}
    d1, m1, d8 = rows[(1, "dense")], rows[(1, "maskahead")], rows[(8, "dense")]
    # params: embed + lm_head (vocab replicated) and norms whole, every layer weight over model=4
    cfg = LW.shape_config("fast-dllm-v2-7b")
    total = sum(r.size for r in __import__("jax").tree_util.tree_leaves(LW.abstract_params(cfg))) * 2
    vocab = 2 * 2 * cfg.vocab_size * cfg.hidden_size
    assert vocab + (total - vocab) / 4 * 0.99 < d1["params"] < vocab + (total - vocab) / 4 * 1.01
    # dense KV: bf16 of every token, per device: batch 1 over seq=2 x model=4, batch 8 over data=2 x model=4
    lanes = cfg.num_layers * cfg.num_kv_heads * 4 * cfg.head_dim
    assert d1["kv_peak"] == d1["kv_end"] == pytest.approx((32768 + 256) * lanes / 8)
    assert d8["kv_peak"] == pytest.approx(8 * (32768 + 256) * lanes / 8)
    # MaskAhead holds the whole prompt at its peak (and its eviction state), far less at the end
    assert m1["kv_peak"] > d1["kv_peak"] * 0.99 and m1["kv_end"] < 0.15 * d1["kv_end"]
    assert plan["max_batch"] == []  # found by compiling
    assert abstract_mesh(d1["mesh"]).axis_sizes == (1, 2, 4)


def test_max_batch_search_brackets_the_fit():
    """Candidates: extrapolated past the largest batch measured, then interpolated between the
    largest that fits and the smallest that does not, until they are within 5%."""
    gib = 2**30
    pts = {1: 6 * gib, 8: 7 * gib, 32: 10 * gib}  # 0.125 GiB per row past 8
    assert LW._next_candidate(pts, 16 * gib, 2) == 80  # 32 + 6 GiB / 0.125
    pts[80] = 20 * gib  # more than linear: bracket [32, 80)
    assert LW._next_candidate(pts, 16 * gib, 2) == 60  # 32 + 6 / 10 * 48 -> 60.8 -> even
    pts[60] = 15 * gib
    assert 60 < LW._next_candidate(pts, 16 * gib, 2) < 80
    assert LW._next_candidate({1: 17 * gib, 8: 18 * gib}, 16 * gib, 2) is None  # nothing fits
    assert LW._next_candidate({1: 6 * gib, 8: 7 * gib, 40: 15.9 * gib, 42: 16.1 * gib}, 16 * gib, 2) is None
