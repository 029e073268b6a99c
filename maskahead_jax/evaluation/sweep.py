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

This module holds the run loop (`run_sweep`: build and validate the policies, check the folder,
generate what results.jsonl lacks); the run fingerprint is in fingerprint.py, results.jsonl /
run.json handling and the resume check in resume.py, the summary table in summary.py. Their
public names are re-exported here.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections import defaultdict
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .. import interrupt
from ..config import GenerationConfig
from . import atomic
from .example import EvalExample, score_example
from .fingerprint import example_digest, model_files_digest, policy_repr, run_fingerprint
from .outlock import out_lock
from .policies import PolicyError, make_policy, policy_budgets, run_label, takes_budget, validate_policy
from .resume import (RunMismatch, cap_label, check_resume, load_rows, rejected_path, row_key,
                     write_run_json)
from .summary import (LONGBENCH_E_BUCKETS, REFERENCE, cap_cell, length_group, summarize, to_markdown,
                      write_summary)
from .tokenizer import Tokenizer

__all__ = [
    # the run loop (here)
    "RunFailed", "SweepResult", "auto_bucket", "build_policies", "run_sweep",
    # fingerprint.py
    "example_digest", "model_files_digest", "policy_repr", "run_fingerprint",
    # resume.py
    "RunMismatch", "cap_label", "check_resume", "load_rows", "rejected_path", "row_key", "write_run_json",
    # summary.py
    "LONGBENCH_E_BUCKETS", "REFERENCE", "cap_cell", "length_group", "summarize", "to_markdown", "write_summary",
]


class RunFailed(RuntimeError):
    """A (policy, capacity) run failed while generating (raised by a strict sweep; the error it
    wraps is its __cause__)."""


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
    every (policy, capacity) is built and validated (`policy.check_run(model.config, resolved)`):
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


@dataclasses.dataclass(frozen=True)
class _Batcher:
    """What every batch of a sweep shares: the generate function and the model it runs with its
    settings, the tokenizer that decodes the outputs, and the run fingerprint and example digests
    each result row carries."""

    generate: Callable
    model: Any
    tokenizer: Tokenizer
    gen: GenerationConfig
    batch_size: int
    max_new_tokens: Optional[int]
    bucket: Any
    pad_batches: bool
    mesh: Any
    strict: bool
    fingerprint: str
    digests: dict


def _run_locked(model, examples, out_dir, tokenizer, *, path, built, fp, reprs, digests, ids, gen, batch_size,
                max_new_tokens, progress, strict, plots, meta, bucket, pad_batches, mesh,
                score_datasets) -> SweepResult:
    """`run_sweep` once its settings are checked and the output folder is locked: reload (and
    repair) results.jsonl, record run.json, generate the rows it lacks, then write budgets.json,
    the summary and the plots."""
    errors = []
    os.makedirs(out_dir, exist_ok=True)
    rows = load_rows(path)
    write_run_json(out_dir, fp, reprs, batch_size)
    done = {row_key(r) for r in rows}
    todo = {(p, c): [e for e in examples if (p, cap_label(c), e.id) not in done] for p, c in built}
    bar = _progress_bar(sum(len(v) for v in todo.values()), progress)
    from ..generate import generate

    batcher = _Batcher(generate, model, tokenizer, gen, batch_size, max_new_tokens, bucket, pad_batches, mesh,
                       strict, fp["fingerprint"], digests)
    with open(path, "a", encoding="utf-8") as fout:
        budgets = _generate_missing(batcher, todo, built, reprs, rows, errors, fout, bar)
    if bar is not None:
        bar.close()
    _write_budgets(out_dir, budgets)
    mine = _rows_of_this_run(rows, built, examples, ids)
    return _finish(mine, errors, fp, reprs, out_dir, path, meta=meta, plots=plots, score_datasets=score_datasets)


def _progress_bar(total: int, progress: bool):
    """A tqdm bar on stderr over the examples left to generate (None without tqdm)."""
    try:
        from tqdm import tqdm
        return tqdm(total=total, disable=not progress, desc="eval", file=sys.stderr)
    except ImportError:  # pragma: no cover
        return None


def _generate_missing(s: _Batcher, todo: dict, built: dict, reprs: dict, rows: list, errors: list, fout,
                      bar) -> dict:
    """Run each (policy, capacity) on its examples that have no row yet, batch by batch
    (`_batches`), adding each batch's rows to `rows` and appending them to results.jsonl (`fout`).
    A run whose generation fails is left at that batch (`_generate_batch`). Returns the per-batch
    budgets of the policies that expose them: {"policy@cap": [(budgets, n examples), ...]}."""
    budgets = {}
    for (p, c), exs in todo.items():
        policy, prep = built[(p, c)], reprs[(p, cap_label(c))]
        if bar is not None:
            bar.set_description(f"{p}@{cap_label(c)}")
        for batch in _batches(exs, s.batch_size):
            done = _generate_batch(s, p, c, policy, batch, len(exs), errors)
            if done is None:
                break
            out, n_prompts = done
            b = policy_budgets(policy, out.stats, s.model.config.num_layers, [len(e.ids) for e in batch])
            if b is not None:
                budgets.setdefault(f"{p}@{cap_label(c)}", []).append((b, len(batch)))
            new = _batch_rows(s, p, c, policy, prep, batch, out, n_prompts)
            lines = [json.dumps(row) for row in new]
            rows.extend(new)
            _append_lines(fout, lines)
            if bar is not None:
                bar.update(len(batch))
    return budgets


def _generate_batch(s: _Batcher, p: str, c: Optional[float], policy, batch: list, n_run: int, errors: list):
    """Generate one batch: max_new_tokens from the override or the batch's examples; a short batch
    of a run with more examples is padded with copies of its last prompt to the full batch size
    (`pad_batches`: it reuses the full batch's compile); prompt bucket `s.bucket` ("auto":
    `auto_bucket`). Returns (generate's output, number of prompts), or None when generation failed:
    the error is added to `errors` (strict: RunFailed, from the error)."""
    cfg = dataclasses.replace(s.gen, max_new_tokens=int(s.max_new_tokens or batch[0].max_new_tokens))
    prompts = [e.ids for e in batch]
    if s.pad_batches and len(prompts) < s.batch_size and n_run > len(batch):
        prompts = prompts + [prompts[-1]] * (s.batch_size - len(prompts))
    q = auto_bucket(max(len(x) for x in prompts)) if s.bucket == "auto" else int(s.bucket)
    try:
        out = s.generate(s.model, prompts, cfg, policy, bucket=q, mesh=s.mesh)
    except Exception as e:
        errors.append(dict(policy=p, capacity=c, error=f"{type(e).__name__}: {e}"))
        if s.strict:
            raise RunFailed(f"{p}@{cap_label(c)}: {type(e).__name__}: {e}") from e
        return None
    return out, len(prompts)


def _batch_rows(s: _Batcher, p: str, c: Optional[float], policy, prep: str, batch: list, out,
                n_prompts: int) -> list[dict]:
    """The result rows of a generated batch, one per example (padding outputs dropped), in the
    field order of results.jsonl."""
    st = out.stats
    rows = []
    for i, e in enumerate(batch):
        pred = s.tokenizer.decode(out.tokens[i])
        rows.append(dict(
            policy=p, capacity=c, id=e.id, dataset=e.dataset, prediction=pred,
            answers=e.answers, score=score_example(e, pred),
            reduction_final=float(st["reduction_final"][i]),
            reduction_peak=float(st["reduction_peak"][i]),
            kv_bytes_final=float(st["kv_bytes_final"][i]), kv_bytes_peak=float(st["kv_bytes_peak"][i]),
            dense_bytes_final=float(st["dense_bytes_final"][i]),
            dense_bytes_peak=float(st["dense_bytes_peak"][i]),
            nfe=int(st["nfe"][i]), n_prompt_tokens=len(e.ids), n_gen_tokens=len(out.tokens[i]),
            length=e.meta.get("length"), depth=e.meta.get("depth"),
            batch_size=n_prompts, batch_wall_s=float(st["wall_s"]),
            evictions=int(st.get("evictions", 0)), run=s.fingerprint, policy_repr=prep,
            example_digest=s.digests[e.id], budget_note=_budget_note(policy, e)))
    return rows


def _append_lines(fout, lines: list) -> None:
    """Append a batch's JSON lines to results.jsonl, flushed and fsync'ed; Ctrl-C (interrupt.py)
    waits until the batch's rows are written."""
    with interrupt.critical():
        fout.write("\n".join(lines) + "\n")
        fout.flush()
        os.fsync(fout.fileno())


def _write_budgets(out_dir: str, budgets: dict) -> None:
    """Merge the runs' example-weighted mean budgets into out_dir/budgets.json (atomically; an
    unreadable old file is replaced)."""
    if not budgets:
        return
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


def _rows_of_this_run(rows: list, built: dict, examples, ids: list) -> list[dict]:
    """The rows of this sweep's (policy, capacity, example) keys (the folder may hold other
    policies' rows), each with its budget_note: rows written before the field get the same note,
    from the policy."""
    keys = {(p, cap_label(c), e) for p, c in built for e in ids}  # rows checked against this run
    mine = [r for r in rows if row_key(r) in keys]
    pols = {(p, cap_label(c)): pol for (p, c), pol in built.items()}
    by_id = {e.id: e for e in examples}
    return [r if "budget_note" in r else dict(r, budget_note=_budget_note(pols[row_key(r)[:2]], by_id[r["id"]]))
            for r in mine]


def _finish(mine: list, errors: list, fp: dict, reprs: dict, out_dir: str, path: str, *, meta, plots,
            score_datasets) -> SweepResult:
    """Summarize the run's rows, write summary.json / summary.md (and the plots), and return the
    sweep's result."""
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
