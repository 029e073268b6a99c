"""profile.decode_roofline on a hand-checked example (Fast-dLLM-v2-7B shape, H200 figures)."""
import pytest

from maskahead_jax.profile import decode_roofline, shape_config


def test_fast_dllm_v2_7b_roofline_by_hand():
    cfg = shape_config("fast-dllm-v2-7b")
    # matmul weights per layer: 3584 * 128 * (2*28 + 2*4) + 3 * 3584 * 18944 = 233,046,016; x 28 layers
    p_layers = 28 * 233_046_016
    p_all = p_layers + 3584 * 152_064  # + lm head
    assert p_all == 7_070_285_824
    ctx = 8192 + 128
    # batch 32, 32-token blocks: 1024 tokens per forward; KV: 28 layers x 4 heads x 512 B x ctx x 32 rows
    kv = 28 * 4 * 512 * ctx * 32
    r = decode_roofline(cfg, 32, 32, ctx, kv)
    flops = 2 * 1024 * p_all + 4 * 1024 * 28 * 28 * 128 * ctx
    assert r["flops"] == pytest.approx(flops) and r["flops"] == pytest.approx(1.7899e13, rel=1e-3)
    assert r["bytes"] == pytest.approx(2 * p_all + kv)
    assert r["bound"] == "compute" and r["roofline_s"] == pytest.approx(flops / 790e12)  # ~22.7 ms
    # batch 1: bandwidth-bound (weights + one row's cache over 4.8 TB/s, ~3.1 ms)
    r1 = decode_roofline(cfg, 1, 32, ctx, kv / 32)
    assert r1["bound"] == "bandwidth"
    assert r1["roofline_s"] == pytest.approx((2 * p_all + kv / 32) / 4.8e12)
