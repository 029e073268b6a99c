"""`generate`, host side: validate, bucket the prompt length, pick the core, jit it once per
shape, time it, run it on a mesh. The cores (block_causal.py, bidirectional.py) are traced once
per (batch, prompt bucket, generation config, policy): one compile, no host syncs inside.
"""
from __future__ import annotations

import functools
import math
import numbers
import time
import warnings
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..config import GenerationConfig, ModelConfig, ResolvedGeneration
from .. import compile_cache, numerics
from ..kernels import attention
from ..model.rope import for_run as rope_for_run
from ..policies import Dense
from ..sharding import run_sharded
from .bidirectional import bidirectional_core
from .block_causal import block_causal_core
from .stats import GenerateOutput, finish


class PromptTooLongError(ValueError):
    """A prompt exceeds GenerationConfig.max_prompt_len (or the model's position range)."""


class BudgetWarning(UserWarning):
    """A policy's floor, not the requested budget, sets what is kept (stats["budget_note"])."""


def _bucket(n: int, quantum: int) -> int:
    return max(quantum, int(math.ceil(n / quantum)) * quantum)


_CORES = {}


def _with_attention(core):
    """The core traced under the attention implementation its generation config asks for."""
    @functools.wraps(core)
    def run(params, prompt, plen, key, draft=None, prefilled=None, *, cfg, gen, policy, cache_dtype,
            phase: str = "all"):
        # dynamic / longrope RoPE fixed at the run's length (padded prompt + whole generated blocks)
        cfg = rope_for_run(cfg, prompt.shape[1] + -(-gen.max_new_tokens // gen.block_size) * gen.block_size)
        with attention.use(gen.attention, gen.attention_interpret):
            return core(params, prompt, plen, key, draft, prefilled, cfg=cfg, gen=gen, policy=policy,
                        cache_dtype=cache_dtype, phase=phase)
    return run


def _core_fn(cfg: ModelConfig, jit: bool):
    core = bidirectional_core if cfg.attention == "bidirectional" else block_causal_core
    if core not in _CORES:
        fn = _with_attention(core)
        # batch-invariant compile options (numerics.py): a prompt's tokens do not depend on its batch
        _CORES[core] = (fn, numerics.jit(fn, static_argnames=("cfg", "gen", "policy", "cache_dtype", "phase")))
    return _CORES[core][1 if jit else 0]


def core_compiles() -> int:
    """Programs the jitted generate cores hold (one per traced (shape, config, policy)): a sweep
    that buckets its prompt lengths adds one per (batch, length bucket) it visits."""
    return sum(j._cache_size() for _, j in _CORES.values() if hasattr(j, "_cache_size"))


_SEEN_COMPILES = [0]


def _relieve_map_pressure() -> None:
    """After calls that compiled, drop JAX's compiled programs if the process nears the kernel's
    memory-map limit (compile_cache.py): a long sweep otherwise dies inside LLVM mid-run."""
    n = core_compiles()
    if n != _SEEN_COMPILES[0]:
        compile_cache.relieve()
        _SEEN_COMPILES[0] = core_compiles()


def _attention_for(gen: ResolvedGeneration, mesh) -> ResolvedGeneration:
    """Check the attention choice (unknown names, no kernels on this backend: ValueError). Under a
    mesh the kernels run per shard (kernels/sharded.py)."""
    attention.resolve(gen.attention)
    return gen


_NONE = object()
_PROMPTS_ARE = "prompts must be a list of token-id lists, e.g. [tok.encode(text)]"


def _is_token(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, (bool, np.bool_))


def _as_id_lists(prompts) -> list:
    """`prompts` as a list of lists of Python ints; TypeError / ValueError saying what the
    input is instead (text, one flat id list, a 1-D or 3-D array, float or bool ids)."""
    if isinstance(prompts, (np.ndarray, jax.Array)):
        arr = np.asarray(prompts)
        if arr.ndim != 2:
            raise ValueError(f"{_PROMPTS_ARE} (or a 2-D [batch, length] array); got a {arr.ndim}-D array"
                             + (": wrap one prompt as [ids]" if arr.ndim == 1 else ""))
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{_PROMPTS_ARE}; got an array of {arr.dtype}")
        return [list(map(int, p)) for p in arr]
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
        raise TypeError(f"{_PROMPTS_ARE}; got {type(prompts).__name__}"
                        + (": encode the text first (tok.encode / tok.encode_prompt)"
                           if isinstance(prompts, (str, bytes)) else ""))
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)):
            raise TypeError(f"{_PROMPTS_ARE}; prompt {i} is text ({p[:30]!r}): encode it first "
                            f"(tok.encode / tok.encode_prompt)")
        if _is_token(p):
            raise TypeError(f"{_PROMPTS_ARE}; got a flat list of ids: wrap one prompt as [ids]")
        if isinstance(p, (np.ndarray, jax.Array)):
            p = np.asarray(p)
            if p.ndim != 1:
                raise ValueError(f"{_PROMPTS_ARE}; prompt {i} is a {p.ndim}-D array")
            p = p.tolist() if np.issubdtype(p.dtype, np.integer) else list(p)
        if not isinstance(p, (list, tuple)):
            raise TypeError(f"{_PROMPTS_ARE}; prompt {i} is a {type(p).__name__}")
        bad = next((t for t in p if not _is_token(t)), _NONE)
        if bad is not _NONE:
            raise TypeError(f"{_PROMPTS_ARE}; prompt {i} holds {bad!r} ({type(bad).__name__}), not an integer "
                            f"token id")
        out.append([int(t) for t in p])
    return out


def _validate_prompts(prompts, cfg: ModelConfig, gen: ResolvedGeneration):
    prompts = _as_id_lists(prompts)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
    for i, p in enumerate(prompts):
        if len(p) > gen.max_prompt_len:
            raise PromptTooLongError(
                f"prompt {i} has {len(p)} tokens, more than max_prompt_len={gen.max_prompt_len}")
        bad = [t for t in p if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {cfg.vocab_size}): {bad[:5]}")
    total = max(len(p) for p in prompts) + gen.max_new_tokens + gen.block_size
    if total > cfg.max_position_embeddings:
        raise PromptTooLongError(
            f"prompt + max_new_tokens needs {total} positions, the model has "
            f"{cfg.max_position_embeddings}")
    return [list(map(int, p)) for p in prompts]


def prompt_bucket(n: int, quantum: int = 64) -> int:
    """Prompt-length bucket: the next multiple of `quantum`, so nearby lengths share a compile."""
    return _bucket(n, quantum)


def generate(model, prompts: Sequence[Sequence[int]], config: GenerationConfig = GenerationConfig(),
             policy=None, *, jit: bool = True, cache_dtype=None, bucket: int = 64,
             mesh=None, draft=None) -> GenerateOutput:
    """Generate for a ragged batch of token-id prompts with a KV-cache policy (None = Dense): one
    run of the core (the public `maskahead_jax.generate` adds a drafting policy's first pass,
    maskahead_jax/drafting.py).

    jit=False runs the very same functions eagerly (a plain-Python debug loop).
    cache_dtype defaults to the params' dtype.
    mesh: a jax.sharding.Mesh (see maskahead_jax.sharding.make_mesh, e.g. "data=2,model=4"):
    params / prompts are placed by the sharding rules and the same core runs under the mesh.
    draft: [B, n] int32 token ids the policy's hooks read as ctx.draft (a first pass's answer).
    """
    cfg: ModelConfig = model.config
    gen = _attention_for(config.resolve(cfg), mesh)
    policy = policy if policy is not None else Dense()
    policy.check_run(cfg, gen)
    prompts = _validate_prompts(prompts, cfg, gen)
    note = policy.budget_note([len(p) for p in prompts])
    if note:
        warnings.warn(note, BudgetWarning, stacklevel=3)
    dtype = jnp.dtype(cache_dtype or model.params["embed"].dtype)
    arr, plen = _prompt_arrays(prompts, cfg, gen, bucket)
    _relieve_map_pressure()
    fn = _core_fn(cfg, jit)
    key = jax.random.PRNGKey(config.seed)
    args = (model.params, jnp.asarray(arr), jnp.asarray(plen), key) + (
        (jnp.asarray(draft),) if draft is not None else ())
    static = dict(cfg=cfg, gen=gen, policy=policy, cache_dtype=dtype)
    timings = {}
    if config.timings and jit and mesh is None:
        res, timings = _timed_run(fn, args, static)
    else:
        t0 = time.perf_counter()
        if mesh is not None:  # sharded run: see maskahead_jax/sharding.py
            res = run_sharded(mesh, fn, model.params, arr, plen, key, jit=jit, **static)
        elif jit:
            res = fn(*args, **static)
        else:
            with jax.disable_jit():
                res = fn(*args, **static)
        res = jax.block_until_ready(res)
        timings = dict(total_s=time.perf_counter() - t0)
    res = jax.tree_util.tree_map(np.asarray, res)
    wall = timings["total_s"]
    out = finish(res, prompts, cfg, gen, wall, policy)
    out.stats["timings"] = timings
    return out


def _prompt_arrays(prompts, cfg: ModelConfig, gen: ResolvedGeneration, bucket: int):
    """([B, Pb] int32 prompts padded with the mask id to the length bucket, [B] int32 lengths)."""
    pb = prompt_bucket(max(len(p) for p in prompts), max(bucket, gen.block_size))
    arr = np.full((len(prompts), pb), cfg.mask_token_id, np.int32)
    for i, p in enumerate(prompts):
        arr[i, :len(p)] = p
    return arr, np.array([len(p) for p in prompts], np.int32)


def lower(model, prompts: Sequence[Sequence[int]], config: GenerationConfig = GenerationConfig(),
          policy=None, *, cache_dtype=None, bucket: int = 64, phase: str = "all", prefilled=None):
    """The jitted generate core for these prompts, lowered but not run: (jax Lowered, args).
    `lowered.compile()` gives the program (`memory_analysis()`: XLA's temporary and argument
    bytes), `compiled(*args)` runs it; phase="prefill" is the program that only builds the
    cache (time to first token) and also returns its `state`; phase="decode" with
    `prefilled=` that state is the rest of the run alone (decode time without subtracting two
    noisy end-to-end times). For benchmarks and ahead-of-time checks; no drafting pass."""
    if (phase == "decode") != (prefilled is not None):
        raise ValueError("phase='decode' takes prefilled= (the `state` of the prefill program's output), "
                         "and only it does")
    cfg: ModelConfig = model.config
    gen = config.resolve(cfg)
    policy = policy if policy is not None else Dense()
    policy.check_run(cfg, gen)
    prompts = _validate_prompts(prompts, cfg, gen)
    arr, plen = _prompt_arrays(prompts, cfg, gen, bucket)
    dtype = jnp.dtype(cache_dtype or model.params["embed"].dtype)
    args = (model.params, jnp.asarray(arr), jnp.asarray(plen), jax.random.PRNGKey(config.seed))
    if prefilled is not None:
        args += (None, prefilled)
    fn = _core_fn(cfg, True)
    return fn.lower(*args, cfg=cfg, gen=gen, policy=policy, cache_dtype=dtype, phase=phase), args


def _timed_run(fn, args, static):
    """Per-phase wall times: compile (ahead of time), prefill (a prefill-only program of the same
    shapes), end to end, and decode = end to end - prefill. Each phase is compiled before timing.
    When timing noise makes end to end <= prefill, decode_s is None and timing_note says why
    (never a negative or clamped-to-zero time)."""
    t0 = time.perf_counter()
    lowered = fn.lower(*args, **static)
    lower_s = time.perf_counter() - t0
    full = lowered.compile()
    compile_s = time.perf_counter() - t0
    pre = fn.lower(*args, phase="prefill", **static).compile()
    jax.block_until_ready(pre(*args))  # warm
    t0 = time.perf_counter()
    jax.block_until_ready(pre(*args))
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = jax.block_until_ready(full(*args))
    total_s = time.perf_counter() - t0
    timings = dict(compile_s=compile_s, trace_lower_s=lower_s, xla_compile_s=compile_s - lower_s,
                   stablehlo_chars=len(lowered.as_text()),
                   prefill_s=prefill_s, total_s=total_s, decode_s=total_s - prefill_s)
    if total_s <= prefill_s:
        timings.update(decode_s=None, timing_note=(
            f"end to end {total_s:.4f}s <= prefill {prefill_s:.4f}s: timing noise (a busy machine?); "
            f"decode time not reported"))
    return res, timings


