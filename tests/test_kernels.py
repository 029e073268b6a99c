"""Scored attention: jnp references, Pallas TPU kernels (interpret mode; lowered for TPU), Pallas
Triton GPU kernels (interpret mode; lowered for CUDA), Mosaic GPU kernels (lowered for CUDA; no CPU
interpreter runs them), all on a GPU when there is one, and the dispatch."""
from __future__ import annotations

import contextlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maskahead_jax import quant as Q
from maskahead_jax.kernels import dispatch, quant_reference, reference

B, H, G, T, D = 1, 2, 2, 8, 64
TOL = dict(rtol=1e-5, atol=1e-5)


def _inputs(s, seed=0, dtype=jnp.float32, d=D, g=G, t=T):
    ks = jax.random.split(jax.random.key(seed), 7)
    n = lambda k, shape: jax.random.normal(k, shape, jnp.float32).astype(dtype)
    q = n(ks[0], (B, H, g, t, d))
    k, v = n(ks[1], (B, H, s, d)), n(ks[2], (B, H, s, d))
    kb, vb = n(ks[3], (B, H, t, d)), n(ks[4], (B, H, t, d))
    valid = jax.random.uniform(ks[5], (B, H, s)) < 0.8
    blk = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (B, t, t))
    rows = jnp.broadcast_to(jnp.arange(t) % 3 != 0, (B, t))
    return q, k, v, valid, kb, vb, blk, rows


def _close(got, want, tol=TOL):
    (o, st), (o_r, st_r) = got, want
    f32 = lambda a: np.asarray(a, np.float32)
    np.testing.assert_allclose(f32(o), f32(o_r), **tol)
    if st_r is None:
        assert st is None
        return
    np.testing.assert_allclose(f32(st.mass), f32(st_r.mass), **tol)
    np.testing.assert_allclose(f32(st.score), f32(st_r.score), **tol)


# --------------------------------------------------------------------------- references

def test_reference_gqa_pooling_and_prefix_normaliser():
    q, k, v, valid, kb, vb, blk, rows = _inputs(48)
    out, st = reference.attention(q, k, v, valid, kb, vb, blk, rows)
    # independent computation: per (head, query row) softmax over valid context keys only
    lg = np.einsum("bhgtd,bhsd->bhgts", q, k) / np.sqrt(D)
    lg = np.where(valid[:, :, None, None], lg, -np.inf)
    p = np.exp(lg - lg.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    sel = np.asarray(rows[0])
    mass = p[:, :, :, sel].mean(axis=(2, 3))  # mean over the G heads and the stat rows
    np.testing.assert_allclose(st.mass, mass, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(st.mass.sum(-1), 1.0, rtol=1e-5)
    assert float(jnp.abs(jnp.where(valid, 0.0, st.mass)).max()) == 0.0
    c = np.einsum("bhs,bhsd->bhd", mass, v)
    np.testing.assert_allclose(st.score, mass * np.linalg.norm(v - c[:, :, None], axis=-1), rtol=1e-4, atol=1e-7)
    # block keys change the output but not the statistics
    out2, st2 = reference.attention(q, k, v, valid, kb * 3.0, vb + 1.0, blk, rows)
    assert float(jnp.abs(out2 - out).max()) > 1e-3
    np.testing.assert_array_equal(st2.mass, st.mass)
    np.testing.assert_array_equal(st2.score, st.score)


@pytest.mark.parametrize("bits,s", [(4, 64), (2, 64), (4, 70)])
def test_quant_reference_equals_float_reference_on_dequantized(bits, s):
    q, k, v, valid, kb, vb, blk, rows = _inputs(s, seed=1)
    ctx = Q.quantize_kv(k, v, bits)
    kd, vd = Q.dequantize_kv(ctx, jnp.float32)
    _close(quant_reference.attention_quant(q, ctx, valid, kb, vb, blk, rows),
           reference.attention(q, kd, vd, valid, kb, vb, blk, rows))


# --------------------------------------------------------------------------- Pallas TPU (interpret)

TPU = dict(impl="pallas_tpu", interpret=True)


@pytest.mark.parametrize("splits", [1, 2])
def test_tpu_float_kernel_matches_reference(splits):
    args = _inputs(512, seed=2)
    _close(dispatch.scored_attention(*args, tile=256, splits=splits, **TPU), reference.attention(*args))


@pytest.mark.parametrize("bits,s", [(4, 512), (2, 520)])  # 520: 8 tokens in the bf16 residual
def test_tpu_packed_kernel_matches_packed_reference(bits, s):
    q, k, v, valid, kb, vb, blk, rows = _inputs(s, seed=3)
    ctx = Q.quantize_kv(k, v, bits)
    want = quant_reference.attention_quant(q, ctx, valid, kb, vb, blk, rows)
    _close(dispatch.scored_attention_quant(q, ctx, valid, kb, vb, blk, rows, tile=256, splits=2, **TPU), want)


def test_tpu_sparse_attention_matches_reference():
    q, k, v, valid, kb, vb, blk, _ = _inputs(96, seed=4, dtype=jnp.bfloat16)
    got = dispatch.sparse_attention(q, k, v, valid, kb, vb, blk, **TPU)
    want, _ = reference.attention(q, k, v, valid, kb, vb, blk)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), rtol=2e-2, atol=2e-2)


def _tpu_lowering(fn, *args):
    """Lower for TPU from this CPU host: runs the Pallas -> Mosaic lowering, which checks the
    block shapes and every op's lowering rule (the Mosaic compiler itself only runs on TPU).
    The lowering asks for the chip's properties; we describe a v5p."""
    from jax._src.pallas.mosaic import tpu_info
    tpu_info.registry.setdefault(
        "cpu", lambda: tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5P, 1))
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


MODEL_S = 16384  # model-like shape: GQA group 7, head_dim 128, 32-token block, 16k context


def _realistic(bits=None, s=MODEL_S, dtype=jnp.bfloat16):
    """Abstract (shape-only) arguments at a model-like shape; a QuantKV context when bits is set."""
    z = lambda *sh: jax.ShapeDtypeStruct(sh, dtype)
    q, k, v = z(1, 2, 7, 32, 128), z(1, 2, s, 128), z(1, 2, s, 128)
    rest = (jax.ShapeDtypeStruct((1, 2, s), bool), z(1, 2, 32, 128), z(1, 2, 32, 128),
            jax.ShapeDtypeStruct((1, 32, 32), bool), jax.ShapeDtypeStruct((1, 32), bool))
    if bits is None:
        return (q, k, v) + rest
    return (q, jax.eval_shape(partial(Q.quantize_kv, bits=bits), k, v)) + rest


def _scored(impl, bits):
    fn = dispatch.scored_attention if bits is None else dispatch.scored_attention_quant
    return partial(fn, impl=impl)


@pytest.mark.parametrize("bits,pool", [(None, "mean"), (4, "mean"), (2, "mean"), (None, "max_joint"),
                                       (4, "mean+max")])
def test_tpu_kernels_lower_at_model_shapes(bits, pool):
    txt = _tpu_lowering(partial(_scored("pallas_tpu", bits), pool=pool), *_realistic(bits))
    # pass 1 and pass 2; another pooling adds pass 3 (the values' distance to its centre)
    assert txt.count("tpu_custom_call") == (2 if pool == "mean" else 3)


# --------------------------------------------------------------------------- GPU: CUDA lowering

GPU_BITS = [None, 4, 2]


def _abstract_gpu():
    """jax >= 0.12's Triton lowering asks for the GPU's properties; from a CPU host it reads them
    off an abstract H200 of the context mesh (jax 0.10 does not ask, and lacks AbstractDevice)."""
    try:
        from jax.sharding import AbstractDevice, AbstractMesh
        mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
            device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    except (ImportError, TypeError):
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh)


def _cuda_lowering(fn, *args):
    with _abstract_gpu():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("bits", GPU_BITS)
def test_mosaic_gpu_kernels_lower_for_cuda_at_model_shapes(bits):
    """Runs the whole Mosaic GPU lowering (layouts, wgmma shapes, swizzles, TMA boxes).

    jax 0.11.2 on an H200 refused the packed ones (a plane index closed over by the pl.run_state
    accumulator step); kernels/gpu.py keeps one SMEM ref per plane since, and lowers on 0.10.2,
    0.11.2 and 0.12."""
    args = _realistic(bits)
    txt = _cuda_lowering(_scored("pallas_gpu", bits), *args)
    assert txt.count("custom_call @mosaic_gpu") == 2  # pass 1 and pass 2
    if bits is None:
        assert "mosaic_gpu" in _cuda_lowering(partial(dispatch.sparse_attention, impl="pallas_gpu"),
                                              *args[:7])


@pytest.mark.parametrize("bits", GPU_BITS)
def test_triton_kernels_lower_for_cuda_at_model_shapes(bits):
    """The Pallas -> Triton IR lowering (block shapes, every op's rule); PTX is built on a GPU.
    A pooling other than the mean adds pass 3; on a GPU it runs on these kernels even when
    Mosaic GPU was asked for (dispatch.pool_impl)."""
    args = _realistic(bits)
    txt = _cuda_lowering(_scored("pallas_triton", bits), *args)
    assert txt.count("xla.gpu.triton") == 2  # pass 1 and pass 2
    pooled = _cuda_lowering(partial(_scored("pallas_gpu", bits), pool="mean+max"), *args)
    assert pooled.count("xla.gpu.triton") == 3 and "mosaic_gpu" not in pooled
    if bits is None:
        assert "xla.gpu.triton" in _cuda_lowering(
            partial(dispatch.sparse_attention, impl="pallas_triton"), *args[:7])


# --------------------------------------------------------------------------- GPU: Triton (interpret)

TRITON = dict(impl="pallas_triton", interpret=True)


def test_triton_float_kernel_matches_reference():
    """4 tiles in 2 splits (one split: the sparse test below)."""
    args = _inputs(256, seed=2)
    _close(dispatch.scored_attention(*args, splits=2, **TRITON), reference.attention(*args))


@pytest.mark.parametrize("bits,s,d", [(4, 256, D), (2, 264, D), (4, 128, 96)])
def test_triton_packed_kernel_matches_packed_reference(bits, s, d):
    """264: 8 tokens in the bf16 residual; head_dim 96: plane width 48 zero-padded to 64."""
    q, k, v, valid, kb, vb, blk, rows = _inputs(s, seed=3, d=d)
    ctx = Q.quantize_kv(k, v, bits)
    want = quant_reference.attention_quant(q, ctx, valid, kb, vb, blk, rows)
    _close(dispatch.scored_attention_quant(q, ctx, valid, kb, vb, blk, rows, splits=2, **TRITON), want)


def test_triton_sparse_attention_matches_reference():
    q, k, v, valid, kb, vb, blk, _ = _inputs(96, seed=4, dtype=jnp.bfloat16)
    got = dispatch.sparse_attention(q, k, v, valid, kb, vb, blk, **TRITON)
    want, _ = reference.attention(q, k, v, valid, kb, vb, blk)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), rtol=2e-2, atol=2e-2)


def _close_model(got, want):
    """bf16 inputs, float16 dots: outputs to bf16 precision, the statistics relative to their max."""
    (o, st), (o_r, st_r) = got, want
    f32 = lambda a: np.asarray(a, np.float32)
    np.testing.assert_allclose(f32(o), f32(o_r), rtol=2e-2, atol=2e-2)
    for a, b in ((st.mass, st_r.mass), (st.score, st_r.score)):
        a, b = f32(a), f32(b)
        assert b.max() > 0
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-3 * b.max())


@pytest.mark.parametrize("bits", [4, 2])
def test_triton_packed_kernel_at_model_like_shape(bits):
    """GQA group 7, head_dim 128, 32-token block (224 rows: 4 row blocks); 520 context tokens:
    8 tiles in 2 splits plus an 8-token bf16 residual (interpret mode runs the grid serially,
    so the context is short here; the 16k context is lowered above and run on the device)."""
    q, k, v, valid, kb, vb, blk, rows = _inputs(520, seed=8, dtype=jnp.bfloat16, d=128, g=7, t=32)
    sl = lambda x: x[:, :1]  # one KV head
    q, k, v, valid, kb, vb = map(sl, (q, k, v, valid, kb, vb))
    ctx = Q.quantize_kv(k, v, bits)
    _close_model(dispatch.scored_attention_quant(q, ctx, valid, kb, vb, blk, rows, splits=2, **TRITON),
                 quant_reference.attention_quant(q, ctx, valid, kb, vb, blk, rows))


# --------------------------------------------------------------------------- other poolings (interpret)

@pytest.mark.parametrize("impl,bits,pool", [
    ("pallas_tpu", 4, "max_joint"), ("pallas_triton", None, "max"),
    ("pallas_triton", None, "max_joint"), ("pallas_triton", 2, "mean+max")])
def test_pooled_statistics_kernels_match_reference(impl, bits, pool):
    """A pooling other than the mean (reference.pool_rows): pass 2 keeps each key's sum and max
    over the selected rows and the max's value sum, pass 3 each value's distance to the pooled
    centre; mass and value score == the references (packed: 8 tokens in the bf16 residual).
    The TPU kernels' float "max" / "mean+max" run in tests/test_attention_impl.py (attend, generate)."""
    s = 72 if bits else 128
    q, k, v, valid, kb, vb, blk, rows = _inputs(s, seed=3, d=32, t=4)
    kw = dict(impl=impl, interpret=True, tile=64 if impl == "pallas_tpu" else 32, pool=pool)
    if bits is None:
        got = dispatch.scored_attention(q, k, v, valid, kb, vb, blk, rows, **kw)
        want = reference.attention(q, k, v, valid, kb, vb, blk, rows, pool=pool)
        mean = reference.attention(q, k, v, valid, kb, vb, blk, rows)[1]
    else:
        ctx = Q.quantize_kv(k, v, bits)
        got = dispatch.scored_attention_quant(q, ctx, valid, kb, vb, blk, rows, **kw)
        want = quant_reference.attention_quant(q, ctx, valid, kb, vb, blk, rows, pool)
        mean = quant_reference.attention_quant(q, ctx, valid, kb, vb, blk, rows)[1]
    _close(got, want)
    assert float(jnp.abs(want[1].mass - mean.mass).max()) > 1e-2  # not the mean's statistics


# --------------------------------------------------------------------------- GPU: Mosaic (interpret)

GPU_INTERPRETER_GAPS = (
    "the Mosaic GPU interpreter (InterpretGPUParams, jax 0.10.2 and 0.12) cannot execute these "
    "kernels: it has no rule for run_state (the wgmma accumulator idiom), layout_cast or "
    "plgpu.load, and it rejects transposed wgmma operands (TransposeTransform) and register "
    "A operands; jax 0.12.1's gets further and stops inside its own callback at copy_smem_to_gmem "
    "('predicate not supported', a JaxRuntimeError); the Mosaic GPU kernels are checked by CUDA "
    "lowering here and on the device")


def _interpreter_gap(e: Exception) -> bool:
    """A gap of the Mosaic GPU interpreter, not a wrong kernel: raised directly (0.10-0.12.0) or,
    from 0.12.1, as a JaxRuntimeError wrapping the interpreter callback's NotImplementedError."""
    if isinstance(e, (NotImplementedError, AttributeError, ValueError)):
        return True
    return isinstance(e, jax.errors.JaxRuntimeError) and "NotImplementedError" in str(e)


def _last_line(e: Exception) -> str:
    lines = [ln for ln in str(e).splitlines() if "Error" in ln]
    return lines[-1].strip() if lines else str(e)


def test_gpu_kernel_interpret_mode():
    args = _inputs(128, seed=5, dtype=jnp.bfloat16)
    try:
        got = dispatch.scored_attention(*args, impl="pallas_gpu", interpret=True)
    except Exception as e:  # noqa: BLE001 - anything that is not an interpreter gap is re-raised
        if not _interpreter_gap(e):
            raise
        from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import (
            reset_gpu_interpret_mode_state)
        reset_gpu_interpret_mode_state()
        pytest.skip(f"{GPU_INTERPRETER_GAPS} ({type(e).__name__}: {_last_line(e)[:80]})")
    _close(got, reference.attention(*args), dict(rtol=3e-2, atol=3e-2))


# --------------------------------------------------------------------------- GPU: on the device

ON_GPU = jax.default_backend() == "gpu"


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU: runs the Pallas GPU kernels for real "
                    "(impl forced, not interpret); Mosaic GPU needs sm90 (H100/H200)")
@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_triton"])
@pytest.mark.parametrize("bits", GPU_BITS)
def test_gpu_kernels_match_reference_on_device(impl, bits):
    """On a GPU machine: each Pallas GPU kernel at the model-like shape (GQA group 7, head_dim 128,
    32-token block, 16k context + an 8-token bf16 residual when packed) == the jnp references."""
    s = MODEL_S + (8 if bits else 0)
    args = list(_inputs(s, seed=9, dtype=jnp.bfloat16, d=128, g=7, t=32))
    q, k, v, valid, kb, vb, blk, rows = args
    if bits is None:
        _close_model(dispatch.scored_attention(*args, impl=impl),
                     dispatch.scored_attention(*args, impl="reference"))
        np.testing.assert_allclose(
            np.asarray(dispatch.sparse_attention(q, k, v, valid, kb, vb, blk, impl=impl), np.float32),
            np.asarray(dispatch.sparse_attention(q, k, v, valid, kb, vb, blk, impl="reference"), np.float32),
            rtol=2e-2, atol=2e-2)
    else:
        ctx = Q.quantize_kv(k, v, bits)
        _close_model(dispatch.scored_attention_quant(q, ctx, valid, kb, vb, blk, rows, impl=impl),
                     dispatch.scored_attention_quant(q, ctx, valid, kb, vb, blk, rows, impl="reference"))


# --------------------------------------------------------------------------- dispatch

@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU fallback")
def test_dispatch_picks_reference_on_cpu():
    assert dispatch.resolve_impl(None) == "reference"
    args = _inputs(40, seed=6)
    _close(dispatch.scored_attention(*args), reference.attention(*args))
    with pytest.raises(ValueError):
        dispatch.resolve_impl("triton")


@pytest.mark.parametrize("version,backend,packed,want", [
    ("0.10.2", "gpu", True, "pallas_triton"), ("0.11.2", "gpu", True, "pallas_triton"),
    ("0.12.0.dev20270101", "gpu", True, "pallas_triton"), ("0.13.0", "gpu", True, "reference"),
    ("0.11.2", "gpu", False, "pallas_gpu"), ("0.13.0", "gpu", False, "pallas_gpu"),
    ("0.11.2", "tpu", True, "pallas_tpu"), ("0.11.2", "cpu", False, "reference")])
def test_dispatch_auto_choice_by_backend_and_jax_version(monkeypatch, version, backend, packed, want):
    """Packed contexts on a GPU take the Triton kernels on the jax versions whose lowering was
    checked, the reference on newer ones; an explicit choice is kept."""
    monkeypatch.setattr(dispatch.jax, "__version__", version)
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: backend)
    assert dispatch.resolve_impl(None, packed=packed) == want
    for impl in ("pallas_gpu", "pallas_triton"):
        assert dispatch.resolve_impl(impl, packed=packed) == impl


def test_dispatch_packed_gpu_without_triton_backend_uses_reference(monkeypatch):
    """And the poolings other than the mean, which the Mosaic GPU kernels do not compute, take
    the Triton kernels when there are any, else the reference."""
    for pool in reference.POOLS:
        want = "pallas_gpu" if pool == "mean" else "pallas_triton"
        assert dispatch.pool_impl("pallas_gpu", pool) == want
        assert dispatch.pool_impl("pallas_tpu", pool) == "pallas_tpu"
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_triton_available", lambda: False)
    assert dispatch.resolve_impl(None, packed=True) == "reference"
    assert dispatch.resolve_impl(None, packed=False) == "pallas_gpu"
    assert dispatch.pool_impl("pallas_gpu", "max") == "reference"


def test_dispatch_block_only_and_sparse_reference():
    q, k, v, valid, kb, vb, blk, rows = _inputs(40, seed=7)
    out, st = dispatch.scored_attention(q, None, None, None, kb, vb, blk, rows)
    assert st is None and out.shape == q.shape
    np.testing.assert_allclose(dispatch.sparse_attention(q, k, v, valid, kb, vb, blk),
                               reference.attention(q, k, v, valid, kb, vb, blk)[0])
