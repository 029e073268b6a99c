"""Policies x budgets sweeps: batched generation with length bucketing, per-example JSONL results
that resume without loss or duplicates, summary table (Markdown + JSON), paired sign tests, plots.

Files written under `out_dir`:
  run.json        the run fingerprint: model, generation and dataset settings (+ the policies' reprs)
  results.jsonl   one line per (policy, capacity, example id), each tagged with the fingerprint
  summary.json    per run: score, per-dataset scores, KV reduction end / peak, NFE, sign tests
  summary.md      the same as a Markdown table
  budgets.json    per-layer / per-head budgets of policies that expose them (MaskKV)
  *.png           pareto.png, needle_<dataset>.png, budgets_<policy>_<cap>.png
Every file but results.jsonl (appended and fsync'ed per batch) is written atomically (atomic.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import sys
import time
from collections import defaultdict
from typing import Callable, Optional, Sequence

import numpy as np

from .. import interrupt
from ..config import GenerationConfig
from . import atomic
from .outlock import out_lock
from .datasets import LONGBENCH_PROMPTS, EvalExample, Tokenizer, score_example
from .policies import (PolicyError, make_policy, policy_budgets, run_label, split_items, takes_budget,
                       validate_policy)
from .stats import paired_sign_test

REFERENCE = "maskahead"


class RunMismatch(ValueError):
    """`out_dir` holds results of a run with other settings (or from before run fingerprints)."""


class RunFailed(RuntimeError):
    """A (policy, capacity) run failed while generating (raised by a strict sweep; the error it
    wraps is its __cause__)."""


def cap_label(cap: Optional[float]) -> str:
    return "full" if cap is None else f"{cap:g}"


def row_key(row: dict) -> tuple:
    return (row["policy"], cap_label(row.get("capacity")), row["id"])


def _digest(obj, n: int = 16) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


def _jsonable(obj):
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def model_files_digest(path: str, sample: int = 1 << 20) -> Optional[str]:
    """Cheap content digest of a model folder: every file but *.md and hidden ones, by relative path,
    size and the sha256 of its first and last `sample` bytes (weights retrained in place change it)."""
    if not path or not os.path.isdir(path):
        return None
    h = hashlib.sha256()
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.startswith(".") or name.endswith(".md"):
                continue
            full = os.path.join(root, name)
            size = os.path.getsize(full)
            h.update(f"{os.path.relpath(full, path)}\0{size}\0".encode())
            with open(full, "rb") as f:
                h.update(f.read(sample))
                if size > 2 * sample:
                    f.seek(size - sample)
                    h.update(f.read(sample))
                elif size > sample:
                    h.update(f.read())
    return h.hexdigest()[:16]


def run_fingerprint(model, gen: GenerationConfig = GenerationConfig(), max_new_tokens: Optional[int] = None,
                    model_path: Optional[str] = None, dataset: Optional[dict] = None) -> dict:
    """The settings that decide a sweep's rows, apart from the policy (each row carries its policy's
    repr) and the example (each row carries the digest of its prompt, references and lengths):
    model (path, files digest, params dtypes, config), the resolved generation config, the
    max_new_tokens override and the caller's dataset options. Execution settings (batch size,
    prompt bucket, mesh) are left out. Returns the JSON-ready components and their digest under
    "fingerprint"."""
    import jax

    dtypes = sorted({str(getattr(x, "dtype", type(x).__name__)) for x in jax.tree_util.tree_leaves(model.params)})
    try:
        g = dataclasses.asdict(gen.resolve(model.config))
    except Exception:  # a bad config fails in generate (reported per run); fingerprint it unresolved
        g = dataclasses.asdict(gen)
    g.pop("max_new_tokens", None)
    # the attention implementation at its default is an execution setting (the same decoding,
    # and it keeps resumes of runs started before the field existed); a forced one is recorded
    if g.get("attention") == "auto" and not g.get("attention_interpret"):
        g.pop("attention", None)
        g.pop("attention_interpret", None)
    g.update(seed=gen.seed, max_new_tokens=int(max_new_tokens) if max_new_tokens else "per example")
    comp = _jsonable(dict(
        model=dict(path=model_path, files=model_files_digest(model_path), params_dtype=",".join(dtypes),
                   config=dataclasses.asdict(model.config)),
        generation=g, dataset=dataset or {}))
    return dict(fingerprint=_digest(comp), **comp)


def example_digest(e: EvalExample) -> str:
    return _digest(dict(dataset=e.dataset, ids=[int(x) for x in e.ids], answers=e.answers,
                        max_new_tokens=e.max_new_tokens, kind=e.kind, meta=e.meta))


def policy_repr(policy) -> str:
    """The policy's repr (a frozen dataclass: every knob); other objects: class and attributes."""
    if dataclasses.is_dataclass(policy) or not hasattr(policy, "__dict__"):
        return repr(policy)
    return f"{type(policy).__qualname__}({', '.join(f'{k}={v!r}' for k, v in sorted(vars(policy).items()))})"


def _flat(d, prefix="") -> dict:
    if not isinstance(d, dict):
        return {prefix: d}
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _fmt_diff(old: dict, new: dict, limit: int = 4) -> tuple[str, str]:
    """'k=v, ...' of the entries that differ, on each side (at most `limit`, then '+N more')."""
    keys = [k for k in sorted(set(old) | set(new)) if old.get(k, "<unset>") != new.get(k, "<unset>")]
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""

    def side(d):
        return ", ".join(f"{k}={d.get(k, '<unset>')}" for k in keys[:limit]) + more
    return side(old), side(new)


def _repr_items(r: str) -> dict:
    """'Cls(a=1, b=(2, 3))' -> {'class': 'Cls', 'a': '1', 'b': '(2, 3)'} (top-level commas only)."""
    m = re.match(r"^([\w.]+)\((.*)\)$", r, re.S)
    if not m:
        return {"repr": r}
    out = {"class": m.group(1)}
    for item in split_items(m.group(2)):
        k, _, v = item.strip().partition("=")
        if k:
            out[k] = v
    return out


def check_resume(out_dir: str, rows: Sequence[dict], fp: dict, reprs: dict, digests: dict,
                 batch_size: Optional[int] = None) -> None:
    """Raise RunMismatch (nothing written) unless the rows and run.json in `out_dir` are of this run:
    same fingerprint, same policy repr per (policy, capacity) label, same example digest per id,
    and the batch size run.json records (when it records one: a prompt's bf16 tokens may depend on
    its batch, docs/evaluation.md "Batch invariance").
    reprs: {(policy, cap label): repr}; digests: {example id: digest}."""
    where = f"--out {out_dir}"
    rp = os.path.join(out_dir, "run.json")
    old = None
    if os.path.exists(rp):
        try:
            with open(rp, encoding="utf-8") as f:
                old = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise RunMismatch(f"{where}: run.json is unreadable ({e}): use another --out") from None
        if old.get("fingerprint") != fp["fingerprint"]:
            comps = ("model", "generation", "dataset")
            a, b = _fmt_diff(_flat({k: old.get(k) or {} for k in comps}), _flat({k: fp[k] for k in comps}))
            raise RunMismatch(f"{where} holds a run with {a}; this run has {b}: use another --out")
        if batch_size and rows and old.get("batch_size") not in (None, int(batch_size)):
            raise RunMismatch(f"{where} holds a run at --batch-size {old['batch_size']}; this run has "
                              f"--batch-size {batch_size}, which can change bfloat16 results "
                              f"(docs/evaluation.md, \"Batch invariance\"): resume with --batch-size "
                              f"{old['batch_size']} or use another --out")
    if rows:
        legacy = sum(1 for r in rows if "run" not in r)
        if legacy:
            raise RunMismatch(f"{where} holds {legacy} result rows that predate run fingerprints (no 'run' "
                              f"field), so their settings are unknown: use another --out")
        other = sorted({r["run"] for r in rows} - {fp["fingerprint"]})
        if other:
            raise RunMismatch(f"{where} holds rows of another run (fingerprint {', '.join(other)}; this run is "
                              f"{fp['fingerprint']}, run.json {'missing' if old is None else 'disagrees'}): "
                              f"use another --out")
    for r in rows:
        k = (r["policy"], cap_label(r.get("capacity")))
        if k in reprs and r.get("policy_repr") != reprs[k]:
            a, b = _fmt_diff(_repr_items(str(r.get("policy_repr"))), _repr_items(reprs[k]))
            raise RunMismatch(f"{where} holds {k[0]}@{k[1]} rows of a policy with {a}; this run's has {b}: "
                              f"use another --out")
        if r["id"] in digests and r.get("example_digest") != digests[r["id"]]:
            n = len({x["id"] for x in rows if x["id"] in digests and x.get("example_digest") != digests[x["id"]]})
            more = f" (and {n - 1} more)" if n > 1 else ""
            raise RunMismatch(f"{where} holds rows for example {r['id']}{more} whose prompt, references or "
                              f"length differ from this run's: use another --out")


def write_run_json(out_dir: str, fp: dict, reprs: dict, batch_size: Optional[int] = None) -> str:
    """Write (atomically) out_dir/run.json: the fingerprint, its components, the policy reprs of
    every (policy, capacity) run so far and the batch size (outside the fingerprint: a resume
    must keep it, `check_resume`)."""
    path = os.path.join(out_dir, "run.json")
    pols, created = {}, time.strftime("%Y-%m-%dT%H:%M:%S")
    old = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
        pols, created = old.get("policies", {}), old.get("created", created)
    pols.update({f"{p}@{c}": r for (p, c), r in reprs.items()})
    extra = {"batch_size": int(batch_size)} if batch_size else (
        {"batch_size": old["batch_size"]} if "batch_size" in old else {})
    return atomic.write_json(path, dict(fp, policies=pols, created=created, **extra), indent=1)


def rejected_path(path: str) -> str:
    """Where `load_rows(repair=True)` moves the lines of `path` it cannot use:
    results.jsonl -> results.rejected.jsonl."""
    root, ext = os.path.splitext(path)
    return f"{root}.rejected{ext or '.jsonl'}"


def load_rows(path: str, repair: bool = True) -> list[dict]:
    """Rows of a results file, first occurrence per key. Lines that are not a JSON row
    (a write cut by a crash), rows without the keys (policy, id) and repeats of a key are
    skipped; with `repair` they are appended, as they were, to `rejected_path(path)`
    (results.rejected.jsonl), the file is rewritten atomically without them, and one line on
    stderr says how many moved where. Nothing is dropped silently."""
    if not os.path.exists(path):
        return []
    rows, seen, bad = [], set(), {"malformed": [], "without the row keys": [], "duplicate": []}
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for line in lines:
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            bad["malformed"].append(line)
            continue
        try:
            k = row_key(r)
            hash(k)
        except (KeyError, TypeError, ValueError):
            bad["without the row keys"].append(line)
            continue
        if k in seen:
            bad["duplicate"].append(line)
            continue
        seen.add(k)
        rows.append(r)
    moved = [x for v in bad.values() for x in v]
    if repair and (moved or (lines and lines[-1] != "")):
        side = rejected_path(path)
        with interrupt.critical():
            if moved:
                with open(side, "a", encoding="utf-8") as f:
                    f.write("\n".join(moved) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
            with atomic.atomic_open(path, "w") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
        if moved:
            what = ", ".join(f"{len(v)} {k}" for k, v in bad.items() if v)
            print(f"[eval] {path}: moved {len(moved)} line{'' if len(moved) == 1 else 's'} it cannot use "
                  f"({what}) to {side}", file=sys.stderr)
    return rows


def _runs(policies: Sequence[str], capacities: Sequence[Optional[float]],
          order: str = "policy") -> list[tuple[str, Optional[float]]]:
    """(policy, capacity) runs: budgetless policies once (capacity None), the others per capacity.
    A policy may be a variant label, name[knob=value,...] (presets.parse_variant). order:
    "policy" (each policy's budgets in turn) or "capacity" (every policy at the first budget,
    then the next: a sweep cut short still compares all policies at its first budget). An
    unknown name is a PolicyError."""
    from .presets import parse_variant

    runs = []
    for p in policies:
        p = p.strip().lower()
        try:
            base = parse_variant(p)[0]
        except ValueError as e:
            raise PolicyError(str(e)) from None
        caps = [None] if not takes_budget(base) else [c for c in capacities if c is not None] or [None]
        for c in caps:
            if (p, c) not in runs:
                runs.append((p, c))
    if order == "capacity":  # every policy at the first budget, then the next (budgetless first)
        caps = [None] + [c for c in capacities if c is not None]
        runs.sort(key=lambda r: caps.index(r[1]) if r[1] in caps else len(caps))
    elif order != "policy":
        raise ValueError(f"order must be 'policy' or 'capacity', got {order!r}")
    return runs


def _batches(exs: list[EvalExample], batch_size: int) -> list[list[EvalExample]]:
    """Bucket by max_new_tokens, sort by prompt length, cut into batches of `batch_size`."""
    groups = defaultdict(list)
    for e in exs:
        groups[e.max_new_tokens].append(e)
    out = []
    for mnt in sorted(groups):
        g = sorted(groups[mnt], key=lambda e: (len(e.ids), e.id))
        out += [g[i:i + batch_size] for i in range(0, len(g), batch_size)]
    return out


def auto_bucket(n: int) -> int:
    """Prompt-bucket quantum for a batch whose longest prompt has n tokens: 64, or 1/8 of the
    enclosing power of two (at most 8 buckets per octave, <= 12.5% padding), so a sweep over
    long ragged prompts compiles a handful of shapes instead of one per batch."""
    return max(64, 2 ** max(0, math.ceil(math.log2(max(n, 1))) - 3))


@dataclasses.dataclass
class SweepResult:
    rows: list
    summary: dict
    paths: dict
    errors: list


def run_sweep(model, examples: Sequence[EvalExample], policies: Sequence[str],
              capacities: Sequence[Optional[float]], out_dir: str, tokenizer: Tokenizer, *,
              gen: GenerationConfig = GenerationConfig(), batch_size: int = 8,
              max_new_tokens: Optional[int] = None, policy_factory: Callable = make_policy,
              progress: bool = True, strict: bool = False, plots: bool = True,
              meta: Optional[dict] = None, bucket="auto", pad_batches: bool = True,
              mesh=None, model_path: Optional[str] = None, dataset: Optional[dict] = None,
              score_datasets: Optional[Sequence[str]] = None, order: str = "policy") -> SweepResult:
    """Run every (policy, capacity) on every example, appending to out_dir/results.jsonl.

    Rows already in the file are skipped (resume), but only rows of this run: the file's rows and
    out_dir/run.json must carry this run's fingerprint (`run_fingerprint`: the model, resolved
    generation config, max_new_tokens, and `model_path` / `dataset` when the caller names them),
    each (policy, capacity)'s rows the same policy repr and each example id's rows the same example
    digest; otherwise RunMismatch is raised before anything in out_dir is touched. Rows written
    before fingerprints existed are refused the same way. Capacity-free policies (dense) run once.
    `gen` is the base GenerationConfig (a preset); max_new_tokens comes from each example unless
    given. Before the first forward, the generation config is resolved against the model and
    every (policy, capacity) is built and validated (`policy.validate(model.config, resolved)`):
    an unknown name, a bad knob or inconsistent settings raise PolicyError (ConfigError /
    ValueError for the generation config) and nothing is run or written. A run that fails while
    generating is reported in `errors` and the others go on (strict: RunFailed, from the error).
    bucket: prompt-length bucket quantum ("auto": `auto_bucket`); pad_batches: fill a short last
    batch with copies of its last prompt (outputs dropped) so it reuses the full batch's compile."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if not examples:
        raise ValueError("no examples to evaluate")
    ids = [e.id for e in examples]
    if len(set(ids)) != len(ids):
        raise ValueError("example ids are not unique")
    if max_new_tokens is not None and int(max_new_tokens) <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    built = build_policies(model.config, gen, policies, capacities, policy_factory,
                           max_new_tokens or max(e.max_new_tokens for e in examples), order=order)
    fp = run_fingerprint(model, gen, max_new_tokens, model_path=model_path, dataset=dataset)
    reprs = {(p, cap_label(c)): policy_repr(pol) for (p, c), pol in built.items()}
    digests = {e.id: example_digest(e) for e in examples}
    path = os.path.join(out_dir, "results.jsonl")
    check_resume(out_dir, load_rows(path, repair=False), fp, reprs, digests, batch_size=batch_size)
    with out_lock(out_dir):  # one eval writes a folder at a time (outlock.py)
        return _run_locked(model, examples, out_dir, tokenizer, path=path, built=built, fp=fp, reprs=reprs,
                           digests=digests, ids=ids, gen=gen, batch_size=batch_size,
                           max_new_tokens=max_new_tokens, progress=progress, strict=strict, plots=plots,
                           meta=meta, bucket=bucket, pad_batches=pad_batches, mesh=mesh,
                           score_datasets=score_datasets)


def _run_locked(model, examples, out_dir, tokenizer, *, path, built, fp, reprs, digests, ids, gen, batch_size,
                max_new_tokens, progress, strict, plots, meta, bucket, pad_batches, mesh,
                score_datasets) -> SweepResult:
    """`run_sweep` once its settings are checked and the output folder is locked."""
    errors = []
    os.makedirs(out_dir, exist_ok=True)
    rows = load_rows(path)
    write_run_json(out_dir, fp, reprs, batch_size)
    done = {row_key(r) for r in rows}
    todo = {(p, c): [e for e in examples if (p, cap_label(c), e.id) not in done] for p, c in built}
    total = sum(len(v) for v in todo.values())
    try:
        from tqdm import tqdm
        bar = tqdm(total=total, disable=not progress, desc="eval", file=sys.stderr)
    except ImportError:  # pragma: no cover
        bar = None
    from ..generate import generate

    budgets = {}
    with open(path, "a", encoding="utf-8") as fout:
        for (p, c), exs in todo.items():
            policy, prep = built[(p, c)], reprs[(p, cap_label(c))]
            if bar is not None:
                bar.set_description(f"{p}@{cap_label(c)}")
            for batch in _batches(exs, batch_size):
                cfg = dataclasses.replace(gen, max_new_tokens=int(max_new_tokens or batch[0].max_new_tokens))
                prompts = [e.ids for e in batch]
                if pad_batches and len(prompts) < batch_size and len(exs) > len(batch):
                    prompts = prompts + [prompts[-1]] * (batch_size - len(prompts))
                q = auto_bucket(max(len(x) for x in prompts)) if bucket == "auto" else int(bucket)
                try:
                    out = generate(model, prompts, cfg, policy, bucket=q, mesh=mesh)
                except Exception as e:
                    errors.append(dict(policy=p, capacity=c, error=f"{type(e).__name__}: {e}"))
                    if strict:
                        raise RunFailed(f"{p}@{cap_label(c)}: {type(e).__name__}: {e}") from e
                    break
                st = out.stats
                b = policy_budgets(policy, st, model.config.num_layers, [len(e.ids) for e in batch])
                if b is not None:
                    budgets.setdefault(f"{p}@{cap_label(c)}", []).append((b, len(batch)))
                lines = []
                for i, e in enumerate(batch):
                    pred = tokenizer.decode(out.tokens[i])
                    row = dict(
                        policy=p, capacity=c, id=e.id, dataset=e.dataset, prediction=pred,
                        answers=e.answers, score=score_example(e, pred),
                        reduction_final=float(st["reduction_final"][i]),
                        reduction_peak=float(st["reduction_peak"][i]),
                        kv_bytes_final=float(st["kv_bytes_final"][i]), kv_bytes_peak=float(st["kv_bytes_peak"][i]),
                        dense_bytes_final=float(st["dense_bytes_final"][i]),
                        dense_bytes_peak=float(st["dense_bytes_peak"][i]),
                        nfe=int(st["nfe"][i]), n_prompt_tokens=len(e.ids), n_gen_tokens=len(out.tokens[i]),
                        length=e.meta.get("length"), depth=e.meta.get("depth"),
                        batch_size=len(prompts), batch_wall_s=float(st["wall_s"]),
                        evictions=int(st.get("evictions", 0)), run=fp["fingerprint"], policy_repr=prep,
                        example_digest=digests[e.id], budget_note=_budget_note(policy, e))
                    lines.append(json.dumps(row))
                    rows.append(row)
                with interrupt.critical():  # Ctrl-C (interrupt.py) waits for the batch's rows
                    fout.write("\n".join(lines) + "\n")
                    fout.flush()
                    os.fsync(fout.fileno())
                if bar is not None:
                    bar.update(len(batch))
    if bar is not None:
        bar.close()
    if budgets:
        budgets = {k: _avg_budgets(v) for k, v in budgets.items()}
        old = {}
        bpath = os.path.join(out_dir, "budgets.json")
        if os.path.exists(bpath):
            try:
                with open(bpath, encoding="utf-8") as f:
                    old = json.load(f)
            except json.JSONDecodeError:
                old = {}
        old.update(budgets)
        atomic.write_json(bpath, old, indent=1)
    keys = {(p, cap_label(c), e) for p, c in built for e in ids}  # rows checked against this run
    mine = [r for r in rows if row_key(r) in keys]
    pols = {(p, cap_label(c)): pol for (p, c), pol in built.items()}
    by_id = {e.id: e for e in examples}
    mine = [r if "budget_note" in r else dict(r, budget_note=_budget_note(pols[row_key(r)[:2]], by_id[r["id"]]))
            for r in mine]  # rows written before the field: the same note, from the policy
    summary = summarize(mine, score_datasets)
    summary["errors"] = errors
    summary["run"] = dict(fp, policies={f"{p}@{c}": r for (p, c), r in reprs.items()})
    if meta:
        summary["meta"] = meta
    paths = write_summary(summary, out_dir)
    paths["results"] = path
    if plots:
        from . import plots as P
        paths.update(P.make_plots(mine, summary, out_dir))
    return SweepResult(rows=mine, summary=summary, paths=paths, errors=errors)


def _budget_note(policy, e: EvalExample) -> Optional[str]:
    """The policy's note when a floor, not the requested budget, sets what it keeps of this
    example's prompt (`budget_note`, the text of generate's BudgetWarning); else None."""
    fn = getattr(policy, "budget_note", None)
    return fn([len(e.ids)]) if fn is not None else None


def build_policies(model_config, gen: GenerationConfig, policies: Sequence[str],
                   capacities: Sequence[Optional[float]], policy_factory: Callable = make_policy,
                   max_new_tokens: Optional[int] = None, order: str = "policy") -> dict:
    """{(policy, capacity): policy} for every run of a sweep, each built by `policy_factory(name,
    capacity)` and validated against the model config and the resolved generation config, before
    anything runs. Errors: PolicyError naming the run (unknown name, bad knob or budget,
    inconsistent settings such as a capacity floor below recent + sinks), ConfigError /
    ValueError for a generation config the model cannot resolve."""
    g = gen if not max_new_tokens else dataclasses.replace(gen, max_new_tokens=int(max_new_tokens))
    resolved = g.resolve(model_config)
    built = {}
    for p, c in _runs(policies, capacities, order):
        label = run_label(p, c)
        try:
            pol = policy_factory(p, c)
        except PolicyError as e:
            raise PolicyError(f"{label}: {e}") from None
        except (ValueError, TypeError, KeyError) as e:
            raise PolicyError(f"{label}: cannot build the policy ({type(e).__name__}: {e})") from None
        validate_policy(pol, model_config, resolved, label)
        built[(p, c)] = pol
    return built


def _avg_budgets(items) -> dict:
    """Example-weighted mean of per-batch budgets (entries whose shapes differ are dropped)."""
    out = {}
    for name in ("layer", "head"):
        arrs = [(np.asarray(b[name], float), n) for b, n in items if b.get(name) is not None]
        arrs = [(a, n) for a, n in arrs if a.shape == arrs[0][0].shape]
        out[name] = (sum(a * n for a, n in arrs) / sum(n for _, n in arrs)).tolist() if arrs else None
    return out


def _mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(np.mean(xs)) if xs else float("nan")


# LongBench-E's length buckets (LongBench eval.py `scorer_e`: the record's `length`, in words)
LONGBENCH_E_BUCKETS = ((4000, "0-4k"), (8000, "4-8k"), (math.inf, "8k+"))


def length_group(row: dict) -> Optional[str]:
    """The length group a result row is reported under: LongBench v1 rows by LongBench-E's
    buckets of the record's word count (0-4k / 4-8k / 8k+), LongBench v2 rows by their own
    short / medium / long label, every other row (testbed, needle grids, RULER) by its context
    length in tokens; None when the row has no length."""
    length = row.get("length")
    if length is None or (isinstance(length, float) and math.isnan(length)):
        return None
    if isinstance(length, str):
        return length
    if row.get("dataset") in LONGBENCH_PROMPTS:
        return next(label for bound, label in LONGBENCH_E_BUCKETS if length < bound)
    return str(int(length))


def _group_order(label: str) -> tuple:
    """0-4k < 4-8k < 8k+, short < medium < long, numbers by value, anything else by name."""
    fixed = [b for _, b in LONGBENCH_E_BUCKETS] + ["short", "medium", "long"]
    if label in fixed:
        return (0, fixed.index(label), "")
    return (1, int(label), "") if label.isdigit() else (2, 0, label)


def _per_length(rs: Sequence[dict], score_ds: Sequence[str]) -> dict:
    """{length group: macro mean over the scored datasets of the group's rows, x100}."""
    groups = defaultdict(lambda: defaultdict(list))
    for r in rs:
        g = length_group(r)
        if g is not None and r["dataset"] in score_ds:
            groups[g][r["dataset"]].append(r["score"])
    return {g: _mean([100 * _mean(v) for v in groups[g].values()])
            for g in sorted(groups, key=_group_order)}


def summarize(rows: Sequence[dict], score_datasets: Optional[Sequence[str]] = None) -> dict:
    """Per run (policy, capacity): n, score (macro mean over `score_datasets`, default all the
    datasets, x100), per-dataset scores, per-length-group scores (`length_group`: LongBench-E's
    buckets for LongBench, context length otherwise; each the macro mean over the group's datasets),
    KV reduction at the end / peak (sum of dense-equivalent bytes / sum of held bytes over the
    examples, and the mean of per-example ratios), mean NFE, and paired sign tests against dense
    and against MaskAhead at the same capacity."""
    by = defaultdict(list)
    for r in rows:
        by[(r["policy"], cap_label(r.get("capacity")))].append(r)
    datasets = sorted({r["dataset"] for r in rows})
    score_ds = list(score_datasets) if score_datasets else datasets
    runs = []
    scores = {k: {r["id"]: r["score"] for r in v} for k, v in by.items()}
    dense_key = next((k for k in by if k[0] == "dense"), None)
    for (p, c), rs in sorted(by.items(), key=lambda kv: (kv[0][0] != "dense", kv[0][0], _capf(kv[0][1]))):
        per_ds = {d: 100 * _mean([r["score"] for r in rs if r["dataset"] == d]) for d in datasets
                  if any(r["dataset"] == d for r in rs)}
        run = dict(
            policy=p, capacity=None if c == "full" else float(c), n=len(rs),
            score=_mean([v for d, v in per_ds.items() if d in score_ds]), per_dataset=per_ds,
            per_length=_per_length(rs, score_ds),
            reduction_final=sum(r["dense_bytes_final"] for r in rs) / max(1.0, sum(r["kv_bytes_final"] for r in rs)),
            reduction_peak=sum(r["dense_bytes_peak"] for r in rs) / max(1.0, sum(r["kv_bytes_peak"] for r in rs)),
            reduction_final_mean=_mean([r["reduction_final"] for r in rs]),
            reduction_peak_mean=_mean([r["reduction_peak"] for r in rs]),
            nfe=_mean([r["nfe"] for r in rs]),
            # examples where a policy floor, not the budget, set what was kept (BudgetWarning)
            floor_over_budget=sum(1 for r in rs if r.get("budget_note")),
            budget_note=next((r["budget_note"] for r in rs if r.get("budget_note")), None))
        if dense_key and (p, c) != dense_key:
            run["vs_dense"] = paired_sign_test(scores[(p, c)], scores[dense_key])
        ref = (REFERENCE, c)
        if p != REFERENCE and ref in scores:
            run["vs_maskahead"] = paired_sign_test(scores[(p, c)], scores[ref])
        runs.append(run)
    return dict(datasets=datasets, runs=runs, score_datasets=score_ds)


def _capf(c: str) -> float:
    return -1.0 if c == "full" else float(c)


def _fmt_test(t: Optional[dict]) -> str:
    if not t:
        return "-"
    return f"+{t['wins']}/-{t['losses']} (p={t['p']:.3g})"


def cap_cell(run: dict) -> str:
    """A summary run's capacity for a table: "full", "10", or "10*" when a policy floor, not the
    budget, set what was kept in any of its examples (`floor_over_budget`)."""
    c = "full" if run["capacity"] is None else f"{run['capacity']:g}"
    return c + ("*" if run.get("floor_over_budget") else "")


def to_markdown(summary: dict) -> str:
    ds = summary["datasets"]
    head = ["policy", "capacity %", "n", "score"] + ds + ["KV red. end", "KV red. peak", "NFE",
                                                         "vs dense (W/L, p)", "vs MaskAhead (W/L, p)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in summary["runs"]:
        cells = [r["policy"], cap_cell(r), str(r["n"]),
                 f"{r['score']:.2f}"] + [f"{r['per_dataset'][d]:.2f}" if d in r["per_dataset"] else "-" for d in ds]
        cells += [f"{r['reduction_final']:.2f}x", f"{r['reduction_peak']:.2f}x", f"{r['nfe']:.1f}",
                  _fmt_test(r.get("vs_dense")), _fmt_test(r.get("vs_maskahead"))]
        lines.append("| " + " | ".join(cells) + " |")
    groups = sorted({g for r in summary["runs"] for g in r.get("per_length", {})}, key=_group_order)
    if len(groups) > 1:
        lines += ["", "Score by length (LongBench: LongBench-E's buckets of the context's word count; "
                  "LongBench v2: its length label; others: context tokens), the macro mean over each "
                  "group's datasets:", "",
                  "| policy | capacity % | " + " | ".join(groups) + " |", "|" + "---|" * (len(groups) + 2)]
        for r in summary["runs"]:
            pl = r.get("per_length", {})
            lines.append("| " + " | ".join([r["policy"], cap_cell(r)]
                                           + [f"{pl[g]:.2f}" if g in pl else "-" for g in groups]) + " |")
    sd = summary.get("score_datasets")
    over = f" over {', '.join(sd)}" if sd and sd != ds else ""
    notes = ["", f"Scores x100 (score: dataset macro mean{over}). KV reduction = dense-equivalent bf16 bytes / held bytes, "
                 "summed over examples. Sign tests: paired by example, ties dropped, exact two-sided binomial."]
    floored = [r for r in summary["runs"] if r.get("floor_over_budget")]
    if floored:
        notes.append("")
        notes.append("`*` (capacity): a policy floor, not the budget, sets what is kept (floor > budget), so the "
                     "row is not a run at that budget:")
        for r in floored:
            notes.append(f"- {r['policy']}@{cap_label(r['capacity'])}: {r['floor_over_budget']} of {r['n']} examples, "
                         f"e.g. {r['budget_note']}")
    for e in summary.get("errors", []):
        notes.append(f"- error: {e['policy']}@{cap_label(e['capacity'])}: {e['error']}")
    return "\n".join(lines + notes) + "\n"


def write_summary(summary: dict, out_dir: str) -> dict:
    """summary.json and summary.md in out_dir, each written atomically."""
    js = os.path.join(out_dir, "summary.json")
    md = os.path.join(out_dir, "summary.md")
    atomic.write_json(js, summary, indent=1, default=float)
    atomic.write_text(md, to_markdown(summary))
    return dict(summary_json=js, summary_md=md)
