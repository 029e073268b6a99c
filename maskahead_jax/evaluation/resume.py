"""A sweep's output folder on resume: the results.jsonl rows (their keys, reading them back and
moving lines it cannot use aside) and run.json (written per run; `check_resume` refuses a folder
whose rows or run.json belong to another run, before anything is written)."""
from __future__ import annotations

import json
import os
import re
import sys
import time
from typing import Optional, Sequence

from .. import interrupt
from . import atomic
from .policies import split_items


class RunMismatch(ValueError):
    """`out_dir` holds results of a run with other settings (or from before run fingerprints)."""


def cap_label(cap: Optional[float]) -> str:
    """A capacity as rows and run labels name it: "full" (None) or "10", "2.5"."""
    return "full" if cap is None else f"{cap:g}"


def row_key(row: dict) -> tuple:
    """A result row's key, (policy, capacity label, example id): one row per key in results.jsonl."""
    return (row["policy"], cap_label(row.get("capacity")), row["id"])


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
