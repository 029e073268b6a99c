"""Per-family key maps from HF checkpoint names to the params pytree (see model/decoder.py).

Each layout is a table of `Rule`s: an HF key template (`{i}` = layer, `{e}` = expert), the
pytree leaf(s) it fills, and a hook naming how the tensor is reshaped. Layer rules fill the
`layers` stack for layers [0, n_dense) and `moe_layers` for the rest; a rule applies to a
layer only when all its targets exist there (so q/k-norm, q/k/v bias, dense-vs-MoE MLP and
tied embeddings all follow the config). `build_plan` enumerates every expected key with its
expected HF shape, which is what the loader validates against before reading any data.
Every hook also carries its inverse, so the same plan writes params back in HF layout
(`export_tensor`, converters/export.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from maskahead_jax.config import ModelConfig
from maskahead_jax.model import param_shapes

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Rule:
    key: str  # HF key template
    targets: tuple[str, ...]  # dotted leaf paths (inside the layer stack for {i} rules)
    hook: str = "copy"


def _r(key: str, *targets: str, hook: str = "copy") -> Rule:
    return Rule(key, targets, hook)


# ------------------------------------------------------------------ hooks
# Each hook knows both directions, so one table drives import and export (converters/export.py):
# the expected HF shape from the slot shapes, HF array -> one array per slot, and back.


class Hook(NamedTuple):
    src: Callable[[list[Shape]], Shape]  # slot shapes -> the HF tensor's shape
    to_params: Callable[[np.ndarray, list[Shape]], list[np.ndarray]]  # HF array -> slot arrays
    to_hf: Callable[[list[np.ndarray]], np.ndarray]  # slot arrays -> HF array (the inverse)


def _prod(s) -> int:
    return int(np.prod(s, dtype=np.int64))


def _linear(n_in: int) -> Hook:
    """torch Linear [out, in] -> kernel [in..., out...]; n_in leading slot axes are inputs."""
    def src(slots: list[Shape]) -> Shape:
        s = slots[0]
        return (_prod(s[n_in:]), _prod(s[:n_in]))

    def conv(x: np.ndarray, slots: list[Shape]) -> list[np.ndarray]:
        return [x.T.reshape(slots[0])]

    def inv(ys: list[np.ndarray]) -> np.ndarray:
        y = ys[0]
        return y.reshape(_prod(y.shape[:n_in]), _prod(y.shape[n_in:])).T

    return Hook(src, conv, inv)


def _flat_src(slots):
    return (_prod(slots[0]),)


def _qkv_src(slots: list[Shape]) -> Shape:
    """[(H + 2 Hkv) * Dh, D] for the fused weight, [(H + 2 Hkv) * Dh] for the fused bias."""
    rows = sum(_prod(s[-2:]) for s in slots)
    return (rows, slots[0][0]) if len(slots[0]) == 3 else (rows,)


def _qkv_conv(x: np.ndarray, slots: list[Shape]) -> list[np.ndarray]:
    """LLaDA2 fused QKV: the output axis is (H + 2 Hkv) heads x Dh, split by heads [H, Hkv, Hkv]."""
    dh = slots[0][-1]
    counts = [s[-2] for s in slots]
    x = x.reshape((sum(counts), dh) + x.shape[1:])
    parts = np.split(x, np.cumsum(counts)[:-1], axis=0)
    if x.ndim == 3:  # weight [h, Dh, D] -> kernel [D, h, Dh]
        return [p.transpose(2, 0, 1) for p in parts]
    return list(parts)  # bias [h, Dh]


def _qkv_inv(ys: list[np.ndarray]) -> np.ndarray:
    """Kernels [D, h, Dh] -> [h, Dh, D], or biases [h, Dh], joined by heads and flattened."""
    if ys[0].ndim == 3:
        x = np.concatenate([y.transpose(1, 2, 0) for y in ys], axis=0)
        return x.reshape(-1, x.shape[-1])
    return np.concatenate(ys, axis=0).reshape(-1)


HOOKS: dict[str, Hook] = {
    "copy": Hook(lambda slots: slots[0], lambda x, slots: [x], lambda ys: ys[0]),
    "linear": _linear(1),  # [D, out...] kernels: q/k/v heads, MLP, router, lm head
    "linear_o": _linear(2),  # [H, Dh, D] output projection
    "flat": Hook(_flat_src, lambda x, slots: [x.reshape(slots[0])],
                 lambda ys: ys[0].reshape(-1)),  # q/k/v bias [h, Dh]
    "qkv": Hook(_qkv_src, _qkv_conv, _qkv_inv),
}

# ------------------------------------------------------------------ layouts

_DENSE_MLP = ("gate_proj", "up_proj", "down_proj")

QWEN = (  # Qwen2 (Fast-dLLM v2, Dream) and Qwen3 (SDAR, DreamReasoner): bias / q-k norm by config
    _r("model.embed_tokens.weight", "embed"),
    _r("model.norm.weight", "final_norm"),
    _r("lm_head.weight", "lm_head", hook="linear"),
    _r("model.layers.{i}.input_layernorm.weight", "attn_norm"),
    _r("model.layers.{i}.post_attention_layernorm.weight", "mlp_norm"),
    _r("model.layers.{i}.self_attn.q_proj.weight", "wq", hook="linear"),
    _r("model.layers.{i}.self_attn.k_proj.weight", "wk", hook="linear"),
    _r("model.layers.{i}.self_attn.v_proj.weight", "wv", hook="linear"),
    _r("model.layers.{i}.self_attn.q_proj.bias", "bq", hook="flat"),
    _r("model.layers.{i}.self_attn.k_proj.bias", "bk", hook="flat"),
    _r("model.layers.{i}.self_attn.v_proj.bias", "bv", hook="flat"),
    _r("model.layers.{i}.self_attn.o_proj.weight", "wo", hook="linear_o"),
    _r("model.layers.{i}.self_attn.q_norm.weight", "q_norm"),
    _r("model.layers.{i}.self_attn.k_norm.weight", "k_norm"),
) + tuple(_r(f"model.layers.{{i}}.mlp.{n}.weight", f"mlp.{n[:-5]}", hook="linear") for n in _DENSE_MLP)

LLADA = (  # LLaDA-8B (OLMo "llama" block): ff_proj is the gate, transformer.ff_out the LM head
    _r("model.transformer.wte.weight", "embed"),
    _r("model.transformer.ln_f.weight", "final_norm"),
    _r("model.transformer.ff_out.weight", "lm_head", hook="linear"),
    _r("model.transformer.blocks.{i}.attn_norm.weight", "attn_norm"),
    _r("model.transformer.blocks.{i}.ff_norm.weight", "mlp_norm"),
    _r("model.transformer.blocks.{i}.q_proj.weight", "wq", hook="linear"),
    _r("model.transformer.blocks.{i}.k_proj.weight", "wk", hook="linear"),
    _r("model.transformer.blocks.{i}.v_proj.weight", "wv", hook="linear"),
    _r("model.transformer.blocks.{i}.q_proj.bias", "bq", hook="flat"),
    _r("model.transformer.blocks.{i}.k_proj.bias", "bk", hook="flat"),
    _r("model.transformer.blocks.{i}.v_proj.bias", "bv", hook="flat"),
    _r("model.transformer.blocks.{i}.attn_out.weight", "wo", hook="linear_o"),
    _r("model.transformer.blocks.{i}.ff_proj.weight", "mlp.gate", hook="linear"),
    _r("model.transformer.blocks.{i}.up_proj.weight", "mlp.up", hook="linear"),
    _r("model.transformer.blocks.{i}.ff_out.weight", "mlp.down", hook="linear"),
)

_L2 = "model.layers.{i}."
LLADA2 = (  # LLaDA2.0 / BailingMoeV2, HF per-expert layout
    _r("model.word_embeddings.weight", "embed"),
    _r("model.norm.weight", "final_norm"),
    _r("lm_head.weight", "lm_head", hook="linear"),
    _r(_L2 + "input_layernorm.weight", "attn_norm"),
    _r(_L2 + "post_attention_layernorm.weight", "mlp_norm"),
    _r(_L2 + "attention.query_key_value.weight", "wq", "wk", "wv", hook="qkv"),
    _r(_L2 + "attention.query_key_value.bias", "bq", "bk", "bv", hook="qkv"),
    _r(_L2 + "attention.query_layernorm.weight", "q_norm"),
    _r(_L2 + "attention.key_layernorm.weight", "k_norm"),
    _r(_L2 + "attention.dense.weight", "wo", hook="linear_o"),
    _r(_L2 + "mlp.gate.weight", "moe.router", hook="linear"),
    _r(_L2 + "mlp.gate.expert_bias", "moe.router_bias"),
) + tuple(
    r for n in _DENSE_MLP for r in (
        _r(_L2 + f"mlp.{n}.weight", f"mlp.{n[:-5]}", hook="linear"),
        _r(_L2 + f"mlp.experts.{{e}}.{n}.weight", f"moe.experts.{n[:-5]}", hook="linear"),
        _r(_L2 + f"mlp.shared_experts.{n}.weight", f"moe.shared.{n[:-5]}", hook="linear"),
    ))

LAYOUTS: dict[str, tuple[Rule, ...]] = {"qwen2": QWEN, "qwen3": QWEN, "llada": LLADA, "llada2": LLADA2}

# Buffers some checkpoints carry that the pure-function model recomputes.
IGNORED = re.compile(r".*\.rotary_emb\.inv_freq$")

# ------------------------------------------------------------------ plan


class Slot(NamedTuple):
    path: tuple[str, ...]  # leaf path in the params pytree
    index: tuple[int, ...]  # leading (layer[, expert]) index into that leaf
    shape: Shape  # the slot's own shape (leaf shape without the leading axes)


class Entry(NamedTuple):
    rule: Rule
    slots: tuple[Slot, ...]
    hf_shape: Shape  # what the checkpoint must hold under this key


def _leaf(tree: dict, dotted: str):
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node if isinstance(node, tuple) else None


def build_plan(cfg: ModelConfig) -> tuple[dict[str, Entry], set[str]]:
    """Every HF key the checkpoint must contain -> where it goes; plus keys that may be ignored."""
    if cfg.layout not in LAYOUTS:
        raise ValueError(f"no key map for layout {cfg.layout!r}; known: {sorted(LAYOUTS)}")
    shapes = param_shapes(cfg)
    nd = cfg.num_dense_mlp_layers
    plan: dict[str, Entry] = {}
    optional: set[str] = set()

    def add(key: str, rule: Rule, stack: tuple[str, ...], tree: dict, index: tuple[int, ...]) -> bool:
        leaves = [_leaf(tree, t) for t in rule.targets]
        if any(s is None for s in leaves):
            return False
        slots = tuple(Slot(stack + tuple(t.split(".")), index, tuple(s[len(index):]))
                      for t, s in zip(rule.targets, leaves))
        plan[key] = Entry(rule, slots, tuple(HOOKS[rule.hook].src([s.shape for s in slots])))
        return True

    for rule in LAYOUTS[cfg.layout]:
        if "{i}" not in rule.key:
            if not add(rule.key, rule, (), shapes, ()) and rule.targets == ("lm_head",):
                optional.add(rule.key)  # tied embeddings: a stored copy of the head is harmless
            continue
        for i in range(cfg.num_layers):
            stack, li = ("layers", i) if i < nd else ("moe_layers", i - nd)
            if stack not in shapes:
                continue
            if "{e}" in rule.key:
                for e in range(cfg.num_experts):
                    add(rule.key.format(i=i, e=e), rule, (stack,), shapes[stack], (li, e))
            else:
                add(rule.key.format(i=i), rule, (stack,), shapes[stack], (li,))
    return plan, optional


def convert_tensor(entry: Entry, x: np.ndarray) -> list[np.ndarray]:
    """Reshape / transpose / split one HF tensor into its slot arrays."""
    return HOOKS[entry.rule.hook].to_params(x, [s.shape for s in entry.slots])


def export_tensor(entry: Entry, arrays: list[np.ndarray]) -> np.ndarray:
    """The inverse of `convert_tensor`: the entry's slot arrays -> the HF tensor (hf_shape)."""
    return HOOKS[entry.rule.hook].to_hf(arrays)
