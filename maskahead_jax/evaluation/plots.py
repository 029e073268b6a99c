"""Plots (matplotlib, Agg, PNG): score vs KV reduction (Pareto), needle heatmaps, MaskKV budgets.
Each PNG is written atomically (a full disk leaves no truncated image)."""
from __future__ import annotations

import json
import os
from collections import defaultdict

import numpy as np

from .atomic import savefig


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def pareto(summary: dict, path: str) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    by = defaultdict(list)
    for r in summary["runs"]:
        by[r["policy"]].append(r)
    for p, rs in sorted(by.items()):
        rs = sorted(rs, key=lambda r: r["reduction_final"])
        x = [r["reduction_final"] for r in rs]
        y = [r["score"] for r in rs]
        if p == "dense":
            ax.scatter(x, y, marker="*", s=160, color="k", label="dense", zorder=3)
        else:
            ax.plot(x, y, marker="o", label=p)
            for r in rs:
                if r["capacity"] is not None:
                    ax.annotate(f"{r['capacity']:g}%", (r["reduction_final"], r["score"]), fontsize=7,
                                xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}x" if v in (2, 3, 5, 20, 30, 50) else ""))
    ys = [r["score"] for r in summary["runs"] if r["score"] == r["score"]]
    if ys and min(ys) >= 0 and max(ys) <= 100:
        ax.set_ylim(-3, 103)
    ax.set_xlabel("KV memory reduction at the end (x, log)")
    ax.set_ylabel("score (x100)")
    ax.set_title("score vs KV memory reduction")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    savefig(fig, path, dpi=110)
    plt.close(fig)
    return path


def needle_heatmaps(rows, out_dir: str) -> dict:
    """One PNG per dataset with length/depth rows: a depth x length heatmap per (policy, capacity)."""
    plt = _plt()
    out = {}
    grid = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r.get("length") is None or r.get("depth") is None:
            continue
        grid[r["dataset"]][(r["policy"], r.get("capacity"))].append(r)
    for ds, runs in grid.items():
        keys = sorted(runs, key=lambda k: (k[0] != "dense", k[0], -1.0 if k[1] is None else k[1]))
        lengths = sorted({r["length"] for rs in runs.values() for r in rs})
        depths = sorted({r["depth"] for rs in runs.values() for r in rs})
        n = len(keys)
        cols = min(n, 4)
        nrows = (n + cols - 1) // cols
        fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols + 0.8, 2.8 * nrows + 0.4), squeeze=False,
                                 layout="constrained")
        im = None
        for ax, k in zip(axes.flat, keys):
            m = np.full((len(depths), len(lengths)), np.nan)
            acc = defaultdict(list)
            for r in runs[k]:
                acc[(depths.index(r["depth"]), lengths.index(r["length"]))].append(r["score"])
            for (i, j), v in acc.items():
                m[i, j] = np.mean(v)
            im = ax.imshow(m, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
            ax.set_xticks(range(len(lengths)), [str(x) for x in lengths], fontsize=7)
            ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
            ax.set_title(f"{k[0]} @ {'full' if k[1] is None else f'{k[1]:g}%'}", fontsize=9)
            ax.set_xlabel("context length", fontsize=8)
            ax.set_ylabel("depth", fontsize=8)
            for (i, j), v in acc.items():
                ax.text(j, i, f"{np.mean(v):.2f}", ha="center", va="center", fontsize=6)
        for ax in list(axes.flat)[n:]:
            ax.axis("off")
        if im is not None:
            fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8)
        fig.suptitle(f"{ds}: score by depth x length", fontsize=10)
        path = os.path.join(out_dir, f"needle_{ds}.png")
        savefig(fig, path, dpi=100)
        plt.close(fig)
        out[f"needle_{ds}"] = path
    return out


def budget_plots(budgets: dict, out_dir: str) -> dict:
    """budgets: {'policy@cap': {'layer': [L], 'head': [[L x H]]}} -> budgets_<policy>_<cap>.png."""
    plt = _plt()
    out = {}
    for key, b in budgets.items():
        layer, head = b.get("layer"), b.get("head")
        if not layer and not head:
            continue
        panels = int(bool(layer)) + int(bool(head))
        fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.4), squeeze=False)
        i = 0
        if layer:
            arr = np.asarray(layer, float).reshape(-1)
            axes[0, i].bar(range(len(arr)), arr)
            axes[0, i].set_xticks(range(len(arr)))
            axes[0, i].set_xlabel("layer")
            axes[0, i].set_ylabel("budget")
            axes[0, i].set_title("per-layer budget")
            i += 1
        if head:
            arr = np.asarray(head, float)
            arr = arr.reshape(arr.shape[0], -1) if arr.ndim > 1 else arr[None]
            im = axes[0, i].imshow(arr, aspect="auto", cmap="viridis")
            axes[0, i].set_xlabel("KV head")
            axes[0, i].set_ylabel("layer")
            axes[0, i].set_title("per-head budget")
            fig.colorbar(im, ax=axes[0, i])
        fig.suptitle(key)
        fig.tight_layout()
        safe = key.replace("@", "_").replace("/", "_")
        path = os.path.join(out_dir, f"budgets_{safe}.png")
        savefig(fig, path, dpi=100)
        plt.close(fig)
        out[f"budgets_{safe}"] = path
    return out


def make_plots(rows, summary: dict, out_dir: str) -> dict:
    paths = {}
    if summary.get("runs"):
        paths["pareto"] = pareto(summary, os.path.join(out_dir, "pareto.png"))
    paths.update(needle_heatmaps(rows, out_dir))
    bpath = os.path.join(out_dir, "budgets.json")
    if os.path.exists(bpath):
        try:
            with open(bpath, encoding="utf-8") as f:
                paths.update(budget_plots(json.load(f), out_dir))
        except (json.JSONDecodeError, ValueError):
            pass
    return paths
