"""Portable training state (--save-state / --resume-state): a run that continues on another machine.

The orbax checkpoints in --run-dir are a folder tree of many small files, fine for a run that
resumes on the same disk. A lent accelerator starts bare and returns at most a few flat files
(docs/testbed_history.md, "Long-context stage"), so the state travels as at most three files in
one folder:

  params.npz     the params (float32; bfloat16 if float32 would pass `max_mb`) and the clock:
                 step, elapsed training seconds, the model config's fields
  opt.npz        every optimizer-state leaf (AdamW's moments, its step count, the injected rate),
                 in the order of the configured optimizer's tree; left out (with a warning) when
                 it would pass `max_mb`: a run resumed without it starts fresh moments and warms
                 them up again (train_testbed.py, `warm_from`)
  metrics.jsonl  the run's metrics log (copied by the caller, train_testbed.py)

Each file is written to a temporary name and renamed, so a run killed while saving leaves the
previous state whole."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import numpy as np

PARAMS, OPT, METRICS = "params.npz", "opt.npz", "metrics.jsonl"


def _keyed(tree) -> dict:
    """{jax key path string: leaf} of a pytree."""
    return {jax.tree_util.keystr(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _nbytes(arrays) -> int:
    return sum(np.asarray(a).nbytes for a in arrays)


def _write_npz(path: str, arrays: dict) -> None:
    tmp = path + ".tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def save_state(state_dir: str, params, opt_state, step: int, elapsed: float, cfg=None,
               max_mb: float = 15.0) -> dict:
    """Write params.npz (and opt.npz when it fits in `max_mb` MiB) into `state_dir`; returns
    {"params_dtype", "opt_saved", "params_mb", "opt_mb"} (what was written)."""
    import ml_dtypes

    os.makedirs(state_dir, exist_ok=True)
    limit = max_mb * 2 ** 20
    P = {k: np.asarray(v, np.float32) for k, v in _keyed(params).items()}
    dtype = "float32"
    if _nbytes(P.values()) > limit:
        dtype = "bfloat16"
        P = {k: v.astype(ml_dtypes.bfloat16) for k, v in P.items()}
        print(f"warning: float32 params pass {max_mb} MiB; the state keeps them in bfloat16", flush=True)
    if _nbytes(P.values()) > limit:
        raise SystemExit(f"--save-state: the params alone pass {max_mb} MiB even in bfloat16")
    meta = {"step": int(step), "elapsed": float(elapsed), "params_dtype": dtype,
            "config": dataclasses.asdict(cfg) if cfg is not None else None}
    arrays = {"p:" + k: (v.view(np.uint16) if dtype == "bfloat16" else v) for k, v in P.items()}
    arrays["meta"] = np.frombuffer(json.dumps(meta, default=str).encode(), np.uint8)
    _write_npz(os.path.join(state_dir, PARAMS), arrays)
    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(opt_state)]
    opt_saved = _nbytes(leaves) <= limit
    opt_path = os.path.join(state_dir, OPT)
    if opt_saved:
        _write_npz(opt_path, {f"{i:04d}": a for i, a in enumerate(leaves)})
    else:
        print(f"warning: the optimizer state ({_nbytes(leaves) / 2 ** 20:.1f} MiB) passes {max_mb} MiB: "
              "not saved; a run resumed from this state re-warms fresh moments", flush=True)
        if os.path.exists(opt_path):  # a stale one from an earlier step must not be restored
            os.remove(opt_path)
    return {"params_dtype": dtype, "opt_saved": opt_saved,
            "params_mb": round(os.path.getsize(os.path.join(state_dir, PARAMS)) / 2 ** 20, 2),
            "opt_mb": round(os.path.getsize(opt_path) / 2 ** 20, 2) if opt_saved else None}


def has_state(state_dir) -> bool:
    return bool(state_dir) and os.path.exists(os.path.join(state_dir, PARAMS))


def read_meta(state_dir: str) -> dict:
    with np.load(os.path.join(state_dir, PARAMS)) as z:
        return json.loads(z["meta"].tobytes().decode())


def load_state(state_dir: str, params_like, opt_like):
    """(params, opt_state or None, step, elapsed, meta) from `state_dir`, shaped and typed as
    `params_like` / `opt_like` (the configured model and a fresh optimizer state). opt_state is
    None when the folder has no opt.npz (the caller starts fresh moments)."""
    import ml_dtypes
    import jax.numpy as jnp

    meta = read_meta(state_dir)
    with np.load(os.path.join(state_dir, PARAMS)) as z:
        stored = {k[2:]: z[k] for k in z.files if k.startswith("p:")}
    want = _keyed(params_like)
    if set(stored) != set(want) or any(stored[k].shape != want[k].shape for k in want):
        raise SystemExit(f"--resume-state {state_dir}: its params do not match the configured model "
                         "(pass the same --layers/--d-model/--heads/... as the run that saved it)")
    if meta.get("params_dtype") == "bfloat16":
        stored = {k: v.view(ml_dtypes.bfloat16) for k, v in stored.items()}
    paths, treedef = jax.tree_util.tree_flatten_with_path(params_like)
    params = jax.tree_util.tree_unflatten(treedef, [
        jnp.asarray(stored[jax.tree_util.keystr(p)].astype(np.float32), leaf.dtype) for p, leaf in paths])
    opt_state, opt_path = None, os.path.join(state_dir, OPT)
    if os.path.exists(opt_path):
        leaves, odef = jax.tree_util.tree_flatten(opt_like)
        with np.load(opt_path) as z:
            got = [z[f"{i:04d}"] for i in range(len(z.files))]
        if len(got) != len(leaves) or any(g.shape != np.shape(l) for g, l in zip(got, leaves)):
            raise SystemExit(f"--resume-state {state_dir}: opt.npz does not match this optimizer's state")
        opt_state = jax.tree_util.tree_unflatten(odef, [jnp.asarray(g, np.asarray(l).dtype)
                                                        for g, l in zip(got, leaves)])
    return params, opt_state, int(meta["step"]), float(meta["elapsed"]), meta


def carry(src: str, dst: str) -> dict:
    """A slim copy of the portable state in `src` for the work tree (a new machine keeps nothing
    else): params.npz in bfloat16 with its clock (step, elapsed) and config, and metrics.jsonl
    (the resumed run's probe / export timers read it); no opt.npz, so a run resumed from it
    continues the step count and the data stream with fresh moments, warmed up again. Returns
    {"step", "params_mb"}."""
    import ml_dtypes

    if not has_state(src):
        raise SystemExit(f"carry: no portable state in {src} (no {PARAMS})")
    meta = read_meta(src)
    with np.load(os.path.join(src, PARAMS)) as z:
        stored = {k: z[k] for k in z.files if k.startswith("p:")}
    if meta.get("params_dtype") != "bfloat16":
        stored = {k: v.astype(ml_dtypes.bfloat16).view(np.uint16) for k, v in stored.items()}
    meta["params_dtype"] = "bfloat16"
    os.makedirs(dst, exist_ok=True)
    stored["meta"] = np.frombuffer(json.dumps(meta, default=str).encode(), np.uint8)
    _write_npz(os.path.join(dst, PARAMS), stored)
    if os.path.exists(os.path.join(src, METRICS)):
        shutil.copyfile(os.path.join(src, METRICS), os.path.join(dst, METRICS))
    if os.path.exists(os.path.join(dst, OPT)):
        os.remove(os.path.join(dst, OPT))
    return {"step": int(meta["step"]), "params_mb": round(os.path.getsize(os.path.join(dst, PARAMS)) / 2 ** 20, 2)}


if __name__ == "__main__":  # python -m experiments.testbed.state carry SRC DST
    import sys

    if len(sys.argv) != 4 or sys.argv[1] != "carry":
        raise SystemExit("usage: python -m experiments.testbed.state carry SRC_STATE_DIR DST_DIR")
    print(json.dumps(carry(sys.argv[2], sys.argv[3])))
