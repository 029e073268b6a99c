"""HF folder / converted orbax folder -> `Model`; `convert` and the `maskahead convert` CLI.

A converted folder holds `config.json` (and the tokenizer files) copied from the source,
`params/` (an orbax StandardCheckpointer save of the params pytree) and `maskahead.json`
(format marker + stored dtype).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from maskahead_jax.config import FAMILY_DEFAULTS, ConfigError, ModelConfig
from maskahead_jax.model import param_shapes
from maskahead_jax.model.container import Model

from .hf_config import model_config_from_hf
from .keymaps import IGNORED, build_plan, convert_tensor
from .tensors import CheckpointError, open_tensors, weight_files

MARKER = "maskahead.json"
PARAMS_DIR = "params"
FORMAT = "maskahead-orbax"


def _np_dtype(dtype) -> Optional[np.dtype]:
    return None if dtype is None else np.dtype(jnp.dtype(dtype))


def read_config(path: str, family: Optional[str] = None) -> ModelConfig:
    """The ModelConfig of an HF or converted folder, with errors that name the folder.

    family: force the model family (see `model_config_from_hf`); a converted folder defaults to
    the family it was converted as."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no such checkpoint folder: {path}")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise CheckpointError(f"{path} has no config.json (expected an HF model folder or a folder "
                              "written by `maskahead convert`)")
    if family is None and is_converted(path):
        family = _read_json(os.path.join(path, MARKER)).get("family")
    hf = _read_json(cfg_path)
    try:
        return model_config_from_hf(hf, family=family)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{cfg_path}: {e}") from e


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def _first(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" (+{len(names) - n} more)" if len(names) > n else "")


def load_hf_params(path: str, cfg: ModelConfig, dtype=None, progress: bool = False,
                   shardings=None) -> dict:
    """Read, validate and convert an HF checkpoint folder into the params pytree.

    Every expected key must be present with the expected shape and no unknown key may be
    left over; this is checked from the file headers before any tensor data is read. Tensors
    are then streamed one at a time into preallocated host buffers and moved to the device
    leaf by leaf, so peak host memory stays near one copy of the model.
    dtype=None keeps the checkpoint's storage dtype (that of the embedding).
    shardings: optional NamedSharding pytree (`maskahead_jax.sharding.param_shardings`): each
    leaf then goes straight into its shards (every device receives only its slice).
    """
    tensors = open_tensors(path)
    plan, optional = build_plan(cfg)
    missing = [k for k in plan if k not in tensors]
    if missing:
        detail = [f"{k} (expected shape {plan[k].hf_shape})" for k in missing]
        raise CheckpointError(f"missing key(s) for {cfg.family} ({cfg.layout} layout) in {path}: "
                              f"{_first(detail)}")
    extra = sorted(k for k in tensors if k not in plan and k not in optional and not IGNORED.match(k))
    if extra:
        raise CheckpointError(f"unexpected key(s) in {path}, not part of the {cfg.layout} layout for "
                              f"this config: {_first(extra)}")
    for k, e in plan.items():
        if tensors[k].shape != e.hf_shape:
            raise CheckpointError(f"wrong shape for {k} in {tensors[k].file}: expected {e.hf_shape}, "
                                  f"found {tensors[k].shape}")
    embed_key = next(k for k, e in plan.items() if e.slots[0].path == ("embed",))
    dt = _np_dtype(dtype)
    if dt is None:
        dt = tensors[embed_key].load().dtype
    if not jnp.issubdtype(dt, jnp.floating):
        dt = np.dtype(np.float32)

    shapes = param_shapes(cfg)
    bufs: dict[tuple[str, ...], np.ndarray] = {}
    for kp, shp in jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))[0]:
        bufs[tuple(p.key for p in kp)] = np.empty(shp, dt)
    order = sorted(plan, key=lambda k: (tensors[k].file, k))
    for k in tqdm(order, desc=f"converting {os.path.basename(os.path.normpath(path))}",
                  disable=not progress, unit="tensor"):
        e = plan[k]
        for slot, arr in zip(e.slots, convert_tensor(e, tensors[k].load())):
            bufs[slot.path][slot.index] = arr

    def to_device(tree, prefix=()):
        out = {}
        for name, sub in tree.items():
            p = prefix + (name,)
            if isinstance(sub, dict):
                out[name] = to_device(sub, p)
            elif shardings is not None:
                out[name] = _put_sharded(bufs.pop(p), _at(shardings, p))
            else:
                out[name] = jnp.asarray(bufs.pop(p))
        return out

    return to_device(shapes)


def _at(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _put_sharded(buf: np.ndarray, sharding):
    from maskahead_jax.sharding import _put

    return _put(buf, sharding)


def _mesh_shardings(cfg: ModelConfig, mesh):
    if mesh is None:
        return None
    from maskahead_jax import sharding as shd

    return shd.param_shardings(cfg, shd.make_mesh(mesh) if isinstance(mesh, (str, dict)) else mesh)


# ------------------------------------------------------------------ orbax


def is_converted(path: str) -> bool:
    return os.path.exists(os.path.join(path, MARKER))


def save_orbax(params: Any, path: str) -> None:
    """Save the params pytree to `path` (an orbax StandardCheckpointer directory)."""
    import orbax.checkpoint as ocp

    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.abspath(path), params)
    ckptr.wait_until_finished()


def restore_orbax(path: str, cfg: ModelConfig, dtype, shardings=None) -> dict:
    """Restore a params pytree saved by `save_orbax`, stored as `dtype`.

    shardings: optional NamedSharding pytree (`maskahead_jax.sharding.param_shardings`): orbax
    then reads every leaf straight into its shards (no full copy on one device).
    """
    import orbax.checkpoint as ocp

    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)
    if shardings is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree_util.tree_map(lambda s: one, param_shapes(cfg), is_leaf=is_shape)
    target = jax.tree_util.tree_map(lambda s, sh: jax.ShapeDtypeStruct(s, dtype, sharding=sh),
                                    param_shapes(cfg), shardings, is_leaf=is_shape)
    try:
        return ocp.StandardCheckpointer().restore(os.path.abspath(path), target)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise CheckpointError(f"cannot restore converted params from {path}: {e}") from e


def load_model(path: str, dtype=None, progress: bool = False, mesh=None,
               family: Optional[str] = None) -> Model:
    """Load an HF folder (safetensors / torch .bin) or a folder written by `convert`.

    family: force the model family (`model_config_from_hf`), e.g. to run a Qwen2 folder without
    a block-diffusion marker as fast_dllm_v2.

    mesh: optional jax Mesh or spec ("data=2,model=4"): params are loaded straight into their
    shards by the rules of `maskahead_jax.sharding` (orbax restores sharded; HF tensors are put
    leaf by leaf from host buffers).
    """
    cfg = read_config(path, family)
    shardings = _mesh_shardings(cfg, mesh)
    if is_converted(path):
        with open(os.path.join(path, MARKER)) as f:
            stored = np.dtype(jnp.dtype(json.load(f)["dtype"]))
        params = restore_orbax(os.path.join(path, PARAMS_DIR), cfg, stored, shardings)
        model = Model(cfg, params)
        dt = _np_dtype(dtype)
        return model if dt is None or dt == stored else model.astype(dt)
    return Model(cfg, load_hf_params(path, cfg, dtype=dtype, progress=progress, shardings=shardings))


def _check_paths(src: str, dst: str) -> None:
    """Refuse a destination that is the source, lies inside it, or holds it."""
    s, d = os.path.realpath(src), os.path.realpath(dst)
    if s == d:
        raise CheckpointError(f"destination {dst} is the source folder {src}; convert into another folder")
    if os.path.commonpath([s, d]) == s:
        raise CheckpointError(f"destination {dst} lies inside the source folder {src}")
    if os.path.commonpath([s, d]) == d:
        raise CheckpointError(f"source {src} lies inside the destination folder {dst}")
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise CheckpointError(f"destination {dst} is a file, not a folder")


def _write_converted(model: Model, src: str, out: str) -> None:
    """Write `model` and the non-weight files of `src` into the (empty) folder `out`."""
    skip = {os.path.basename(f) for f in weight_files(src)} | {
        "model.safetensors.index.json", "pytorch_model.bin.index.json", MARKER}
    for name in os.listdir(src):
        full = os.path.join(src, name)
        if os.path.isfile(full) and name not in skip:
            shutil.copy2(full, os.path.join(out, name))
    save_orbax(model.params, os.path.join(out, PARAMS_DIR))
    leaf = jax.tree_util.tree_leaves(model.params)[0]
    with open(os.path.join(out, MARKER), "w") as f:
        json.dump({"format": FORMAT, "version": 1, "dtype": str(leaf.dtype),
                   "family": model.config.family, "layout": model.config.layout}, f, indent=1)


def convert(src: str, dst: str, dtype=None, progress: bool = True, overwrite: bool = False,
            family: Optional[str] = None) -> str:
    """Convert `src` (HF or converted folder) into an orbax folder at `dst`; returns `dst`.

    The non-weight files of `src` (config.json, tokenizer, generation config) are copied along.
    `src` is read and validated in full before `dst` is touched; the result is written to a
    hidden sibling folder and renamed into place, so a failure leaves `dst` as it was.
    family: force the model family (recorded in maskahead.json, used when `dst` is loaded).
    """
    _check_paths(src, dst)
    if os.path.isdir(dst) and os.listdir(dst) and not overwrite:
        raise CheckpointError(f"destination {dst} exists and is not empty (use overwrite / --force)")
    model = load_model(src, dtype=dtype, progress=progress, family=family)
    parent, name = os.path.split(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    old = tmp.replace(".tmp-", ".old-")
    try:
        _write_converted(model, src, tmp)
        if os.path.exists(dst):
            os.rename(dst, old)
        try:
            os.rename(tmp, dst)
        except BaseException:
            if os.path.exists(old):
                os.rename(old, dst)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.islink(old):
        os.unlink(old)
    else:
        shutil.rmtree(old, ignore_errors=True)
    return dst


def cli_convert(argv: Optional[Sequence[str]] = None) -> int:
    """`maskahead convert SRC DST [--dtype bfloat16] [--force]`; returns the exit status."""
    ap = argparse.ArgumentParser(prog="maskahead convert",
                                 description="Convert an HF checkpoint folder to a maskahead orbax folder.")
    ap.add_argument("src", help="HF folder (config.json + *.safetensors or pytorch_model*.bin)")
    ap.add_argument("dst", help="output folder")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="parameter dtype (default: the checkpoint's)")
    ap.add_argument("--force", action="store_true", help="replace a non-empty DST (only once SRC has converted)")
    ap.add_argument("--family", default=None, choices=sorted(FAMILY_DEFAULTS),
                    help="force the model family (default: from config.json; a plain autoregressive "
                         "qwen2 / qwen3 config is refused without it)")
    args = ap.parse_args(argv)
    try:
        out = convert(args.src, args.dst, dtype=args.dtype, overwrite=args.force, family=args.family)
    except (CheckpointError, FileNotFoundError) as e:
        print(f"maskahead convert: error: {e}", file=sys.stderr)
        return 1
    print(f"converted {args.src} -> {out}")
    return 0
