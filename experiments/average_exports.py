"""Average the weights of exported testbed folders of one shape (a "model soup").

  python experiments/average_exports.py maskahead_jax/testbed runs/bd19/export --weights 0.5,0.5 \
      --out runs/soup

Why: a run fine-tuned from an export trades one skill for another (stages 14-18 in
docs/testbed_history.md: retrieval up, the long answer down). Both ends of such a run lie in one
basin, so a weighted mean of their parameters is a model too, and often keeps what each end was good at. The result is
written as an HF-layout folder (config, bfloat16 safetensors, tokenizer), like the training
export (experiments/testbed/export.py), and loads with `load_pretrained`.
"""
from __future__ import annotations

import argparse

import jax
import numpy as np

from experiments.testbed.export import export_hf
from maskahead_jax.api import load_pretrained


def average_params(trees: list, weights: list[float]):
    """sum_i w_i * tree_i in float32, leaf by leaf (the weights are normalised to sum to 1)."""
    total = float(sum(weights))
    if len(trees) != len(weights) or not trees or total <= 0 or min(weights) < 0:
        raise ValueError(f"need one non-negative weight per model, summing above 0; got {weights} "
                         f"for {len(trees)} models")
    w = [x / total for x in weights]
    return jax.tree_util.tree_map(
        lambda *leaves: sum(wi * np.asarray(l, np.float32) for wi, l in zip(w, leaves)), *trees)


def average_folders(paths: list[str], weights: list[float], out: str) -> str:
    """Load each folder in float32, check that they share one config, write the weighted mean."""
    models = [load_pretrained(p, dtype="float32") for p in paths]
    cfg = models[0].config
    for p, m in zip(paths[1:], models[1:]):
        if m.config != cfg:
            diff = {k: (getattr(cfg, k), getattr(m.config, k)) for k in cfg.__dataclass_fields__
                    if getattr(cfg, k) != getattr(m.config, k)}
            raise ValueError(f"{p} has another config than {paths[0]}: {diff}")
    return export_hf(average_params([m.params for m in models], weights), cfg, out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folders", nargs="+", help="exported folders of one shape")
    ap.add_argument("--weights", default="", help="comma list, one per folder (default: equal)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if len(a.folders) < 2:
        ap.error("give at least two folders")
    try:
        w = [float(x) for x in a.weights.split(",")] if a.weights else [1.0] * len(a.folders)
    except ValueError:
        ap.error(f"--weights must be numbers, got {a.weights!r}")
    if len(w) != len(a.folders):
        ap.error(f"--weights has {len(w)} values for {len(a.folders)} folders")
    print(average_folders(a.folders, w, a.out))


if __name__ == "__main__":
    main()
