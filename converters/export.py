"""The params pytree -> an HF-layout state dict / safetensors folder: the key maps run backwards.

`export_hf_state_dict` walks the same plan the loader validates against (`keymaps.build_plan`)
and applies each rule's inverse hook, so every layout the loader reads (qwen2, qwen3, llada,
llada2) is written with the HF key names, torch Linear [out, in] weights, fused QKV and one key
per layer (and expert). Loading the result gives the same params back; exporting params loaded
from an HF checkpoint gives its tensors back, bit for bit, except the buffers the loader ignores
(`keymaps.IGNORED`) and a stored copy of a tied head.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

import jax
import numpy as np

from maskahead_jax.config import ModelConfig
from maskahead_jax.model import param_shapes

from .keymaps import build_plan, export_tensor

WEIGHTS_NAME = "model.safetensors"


def _leaves(tree: Any) -> dict[tuple[str, ...], Any]:
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_shape)[0]
    return {tuple(str(getattr(p, "key", p)) for p in kp): leaf for kp, leaf in flat}


def _check_params(params: Any, cfg: ModelConfig) -> dict[tuple[str, ...], Any]:
    want = _leaves(param_shapes(cfg))
    got = _leaves(params)
    if set(got) != set(want):
        missing = sorted(".".join(p) for p in set(want) - set(got))
        extra = sorted(".".join(p) for p in set(got) - set(want))
        raise ValueError(f"params do not match the {cfg.layout} layout of this config: "
                         f"missing {missing or 'none'}, unexpected {extra or 'none'}")
    for p, shape in want.items():
        if tuple(np.shape(got[p])) != shape:
            raise ValueError(f"params leaf {'.'.join(p)} has shape {tuple(np.shape(got[p]))}, "
                             f"the config says {shape}")
    return got


def export_hf_state_dict(params: Any, cfg: ModelConfig, dtype=None) -> dict[str, np.ndarray]:
    """Every HF key of `cfg`'s layout -> its tensor (C-contiguous numpy), from the params pytree.

    dtype: cast each tensor to this numpy dtype after the layout change (None keeps the params'
    dtype; jax bfloat16 leaves come back as ml_dtypes.bfloat16). Tied embeddings write no head.
    """
    leaves = _check_params(params, cfg)
    host: dict[tuple[str, ...], np.ndarray] = {}

    def leaf(path: tuple[str, ...]) -> np.ndarray:
        if path not in host:
            host[path] = np.asarray(leaves[path])
        return host[path]

    plan, _ = build_plan(cfg)
    out: dict[str, np.ndarray] = {}
    for key, entry in plan.items():
        x = export_tensor(entry, [leaf(s.path)[s.index] for s in entry.slots])
        assert x.shape == entry.hf_shape, (key, x.shape, entry.hf_shape)
        x = np.ascontiguousarray(x)
        out[key] = x if dtype is None else x.astype(dtype)
    return out


def save_hf(params: Any, cfg: ModelConfig, out_dir: str, config: Optional[dict] = None,
            dtype=None, metadata: Optional[dict] = None) -> str:
    """Write `out_dir/model.safetensors` (one file, `export_hf_state_dict`) and, when `config`
    is given, that dict as `out_dir/config.json`; returns `out_dir`.

    metadata: the safetensors header metadata (default {"format": "pt"}, what transformers'
    save_pretrained writes and expects)."""
    from safetensors.numpy import save_file

    tensors = export_hf_state_dict(params, cfg, dtype=dtype)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, WEIGHTS_NAME),
              metadata={"format": "pt"} if metadata is None else metadata)
    if config is not None:
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
    return out_dir
