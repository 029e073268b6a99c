"""Model surgery for continuing from an export: deeper (`grow_layers`, --grow-after) or wider
(`grow_heads`, --grow-heads) params that compute the same function as the loaded ones, and
`load_init` (--init-from), which loads an exported folder through the library's loader."""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp


_OUTPUT_PROJECTIONS = (("wo",), ("mlp", "down"))  # a layer's writes into the residual stream


def parse_grow_after(text) -> list[int]:
    """--grow-after '1,3' -> [1, 3]: the original layers after which a new layer goes."""
    if not text:
        return []
    try:
        out = sorted(int(x) for x in str(text).split(","))
    except ValueError:
        raise SystemExit(f"--grow-after {text!r}: want layer indices, e.g. 1,3") from None
    if any(i < 0 for i in out):
        raise SystemExit(f"--grow-after {text!r}: layer indices must be >= 0")
    return out


def grow_layers(params, after: list[int]):
    """Deeper params that compute the same function: after each original layer i in `after`, a copy
    of layer i whose output projections (attention `wo`, MLP `down`) are zero, so it adds nothing
    to the residual stream until training moves them. Its queries and keys start as layer i's, so
    its attention reads what layer i reads. params["layers"] leaves are stacked [num_layers, ...]."""
    layers = params["layers"]
    n = jax.tree_util.tree_leaves(layers)[0].shape[0]
    bad = [i for i in after if i >= n]
    if bad:
        raise SystemExit(f"--grow-after: layer {bad[0]} does not exist (the model has {n} layers: 0..{n - 1})")
    order = []  # (source layer, zeroed output projections)
    for i in range(n):
        order.append((i, False))
        order += [(i, True)] * after.count(i)

    def grow(path, a):
        keys = tuple(getattr(k, "key", k) for k in path)
        out = any(keys[-len(o):] == o for o in _OUTPUT_PROJECTIONS)
        return jnp.stack([jnp.zeros_like(a[i]) if z and out else a[i] for i, z in order])

    return {**params, "layers": jax.tree_util.tree_map_with_path(grow, layers)}


def _append_heads(a, n_new: int, axis: int, key=None):
    """`a` with n_new heads appended on `axis`: random with a's spread (`key` given) or zeros."""
    shape = a.shape[:axis] + (n_new,) + a.shape[axis + 1:]
    extra = jnp.std(a) * jax.random.normal(key, shape, a.dtype) if key is not None else jnp.zeros(shape, a.dtype)
    return jnp.concatenate([a, extra], axis)


def grow_heads(params, heads: int, kv_heads: int, key):
    """Params with more attention heads that compute the same function: new query heads are
    appended after the old ones and new key/value heads after theirs (the query -> key/value
    grouping, head h reading kv head h // (heads / kv_heads), must stay the same, so the old heads
    keep their keys), new projections are random with the spread of the old ones (biases zero),
    and the new heads' rows of the output projection `wo` are zero: they add nothing to the
    residual stream until training moves them. Stacked layer groups: [n, d, heads, head_dim]."""
    out = dict(params)
    for name in ("layers", "moe_layers"):
        if name not in params:
            continue
        lay = dict(params[name])
        h, hk = lay["wq"].shape[2], lay["wk"].shape[2]
        if heads < h or kv_heads < hk or heads * hk != kv_heads * h:
            raise SystemExit(f"--grow-heads: {h} query / {hk} key-value heads cannot grow into {heads} / "
                             f"{kv_heads} (need at least as many of each, {h // hk} query heads per "
                             "key-value head as before)")
        key, *keys = jax.random.split(key, 4)
        new = {"q": heads - h, "k": kv_heads - hk, "v": kv_heads - hk}
        for (p, n_new), k in zip(new.items(), keys):
            lay[f"w{p}"] = _append_heads(lay[f"w{p}"], n_new, 2, k)  # [n, d, heads, head_dim]
            if f"b{p}" in lay:
                lay[f"b{p}"] = _append_heads(lay[f"b{p}"], n_new, 1)  # [n, heads, head_dim]
        lay["wo"] = _append_heads(lay["wo"], heads - h, 1)  # [n, heads, head_dim, d]
        out[name] = lay
    return out


def load_init(path: str, like, grow_after=(), widen_heads: bool = False, seed: int = 0):
    """The float32 params of an exported folder (deepened by grow_layers when `grow_after` names
    layers, given `like`'s head counts by grow_heads when `widen_heads`), checked against `like`
    (the configured model)."""
    from maskahead_jax.api import load_pretrained

    loaded = load_pretrained(path, dtype="float32").params
    if grow_after:
        loaded = grow_layers(loaded, list(grow_after))
    if widen_heads:
        group = like.get("layers", like.get("moe_layers"))
        loaded = grow_heads(loaded, group["wq"].shape[2], group["wk"].shape[2],
                            jax.random.PRNGKey(seed + 1))
    want = jax.tree_util.tree_map(lambda a: a.shape, like)
    got = jax.tree_util.tree_map(lambda a: a.shape, loaded)
    if want != got:
        raise SystemExit(f"--init-from {path}: parameter shapes {got} do not match the "
                         f"configured model {want} (pass the same --layers/--d-model/... it was trained with; "
                         f"with --grow-after, --layers counts the new layers too; with --grow-heads, "
                         f"--heads/--kv-heads the new heads and --head-dim stays the loaded one)")
    return loaded



def loaded_logits_shift(path: str) -> bool:
    """Whether the exported folder at `path` predicts with shifted logits (config.json
    `logits_shift` true): a run from it without --logits-shift has to form its lookups again."""
    cfg = os.path.join(path, "config.json")
    if not os.path.exists(cfg):
        return False
    with open(cfg) as f:
        return json.load(f).get("logits_shift") is True
