"""Offline layer importance for MaskKV's boundary-aware layer budgets (research/maskkv.md §3a, §8).

  I^(l) = 1 - mean_i cos_sim(h_in,i^(l), h_out,i^(l))                                   (Eq. 8)

h_in = the residual stream entering layer l's attention sub-layer, h_out = h_in + attention
output (the residual stream after the attention sub-layer); the mean runs over every token of
every calibration sequence. The layer math is re-run here from the public pieces (rms_norm,
apply_rope, reference.attention, swiglu / moe_mlp) over params["layers"] / params["moe_layers"],
with the model's own attention pattern (bidirectional or block-causal); the decoder is untouched.

    python -m maskahead_jax.calibrate MODEL_DIR [--tokens calib.json] [--samples 8 --length 512]
        [--out MODEL_DIR/maskkv_layer_importance.json]

--tokens: a JSON list of token-id lists (the calibration set; the paper does not name one, so
without it random in-vocabulary tokens are used and the output says so).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import numerics
from .config import ModelConfig
from .model import embed, full_mask, moe_mlp, rms_norm, rope_tables, swiglu
from .model.decoder import attention_sublayer


def _layer_params(params, cfg: ModelConfig, l: int):
    nd = cfg.num_dense_mlp_layers
    if l < nd:
        return jax.tree_util.tree_map(lambda a: a[l], params["layers"]), False
    return jax.tree_util.tree_map(lambda a: a[l - nd], params["moe_layers"]), True


@functools.partial(numerics.jit, static_argnames=("cfg",))
def _cos_sums(params, tokens, valid, *, cfg: ModelConfig):
    """[L] sums over valid tokens of cos(h_in, h_in + attn_out)."""
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = full_mask(pos, cfg.attention, cfg.block_size, key_valid=valid)
    cos, sin = rope_tables(pos, cfg)
    x = embed(params, tokens)
    sums = []
    for l in range(cfg.num_layers):
        p, moe = _layer_params(params, cfg, l)
        h_in = x
        h_out = x + attention_sublayer(p, x, cos, sin, cfg, None, mask)[0]
        a, o = h_in.astype(jnp.float32), h_out.astype(jnp.float32)
        c = (a * o).sum(-1) / jnp.maximum(jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(o, axis=-1), 1e-12)
        sums.append(jnp.where(valid, c, 0.0).sum())
        hm = rms_norm(h_out, p["mlp_norm"], cfg.rms_eps)
        x = h_out + (moe_mlp(p["moe"], hm, cfg) if moe else swiglu(p["mlp"], hm))
    return jnp.stack(sums)


def layer_importance(model, token_batches: Iterable) -> np.ndarray:
    """I^(l) [L] = 1 - mean cos(h_in, h_out) of every layer's attention sub-layer over all tokens.

    token_batches: an iterable of batches; a batch is an int array [B, T] / [T] or a list of
    token-id lists (ragged lists are right-padded and the padding is masked out)."""
    cfg = model.config
    tot = np.zeros(cfg.num_layers, np.float64)
    n = 0
    for batch in token_batches:
        if isinstance(batch, (np.ndarray, jax.Array)):
            arr = np.asarray(batch, np.int32)
            arr = arr[None] if arr.ndim == 1 else arr
            valid = np.ones(arr.shape, bool)
        else:
            rows = [list(r) for r in batch]
            if rows and not isinstance(rows[0], list):
                rows = [rows]
            t = max(len(r) for r in rows)
            arr = np.full((len(rows), t), cfg.pad_token_id or 0, np.int32)
            valid = np.zeros(arr.shape, bool)
            for i, r in enumerate(rows):
                arr[i, :len(r)] = r
                valid[i, :len(r)] = True
        if arr.size == 0:
            continue
        tot += np.asarray(_cos_sums(model.params, jnp.asarray(arr), jnp.asarray(valid), cfg=cfg), np.float64)
        n += int(valid.sum())
    if n == 0:
        raise ValueError("layer_importance needs at least one calibration token")
    return 1.0 - tot / n


def load_importance(path: str) -> tuple[float, ...]:
    """The `layer_importance` tuple saved by main() (for MaskKV(layer_importance=...))."""
    with open(path) as f:
        return tuple(float(x) for x in json.load(f)["layer_importance"])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="maskahead-calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="model folder (HF layout or converted)")
    ap.add_argument("--tokens", help="JSON list of token-id lists (the calibration set)")
    ap.add_argument("--samples", type=int, default=8, help="random sequences without --tokens")
    ap.add_argument("--length", type=int, default=512, help="random sequence length")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="output JSON (default MODEL/maskkv_layer_importance.json)")
    ap.add_argument("--rope-theta", type=float, default=None, help="replace the model's RoPE base")
    ap.add_argument("--rope-scaling", default=None, help="replace its RoPE scaling: yarn:4, linear:2, ... or none")
    ap.add_argument("--max-positions", type=int, default=None, help="override its max_position_embeddings")
    args = ap.parse_args(argv)
    from .api import load_pretrained

    model = load_pretrained(args.model, rope_theta=args.rope_theta, rope_scaling=args.rope_scaling,
                            max_position_embeddings=args.max_positions)
    cfg = model.config
    if args.tokens:
        with open(args.tokens) as f:
            seqs = [list(map(int, s)) for s in json.load(f)]
        source = os.path.abspath(args.tokens)
    else:
        rng = np.random.RandomState(args.seed)
        hi = min(cfg.vocab_size, cfg.mask_token_id) if cfg.mask_token_id else cfg.vocab_size
        seqs = [list(map(int, rng.randint(0, hi, size=args.length))) for _ in range(args.samples)]
        source = f"random tokens (seed {args.seed}): no calibration set given"
    batches = [seqs[i:i + args.batch] for i in range(0, len(seqs), args.batch)]
    imp = layer_importance(model, batches)
    out = args.out or os.path.join(args.model, "maskkv_layer_importance.json")
    with open(out, "w") as f:
        json.dump(dict(layer_importance=[float(x) for x in imp], num_layers=cfg.num_layers,
                       family=cfg.family, samples=len(seqs), tokens=int(sum(map(len, seqs))),
                       source=source, measure="1 - mean cos(attn-sublayer input, input + attn output)"),
                  f, indent=1)
    print(json.dumps(dict(out=out, layer_importance=[round(float(x), 6) for x in imp])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
