"""Run fingerprints of a sweep: what decides its rows (model, resolved generation config,
dataset options), each policy's repr and each example's digest, so a resume reuses only rows of
the very same run (resume.check_resume compares them)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Optional

from ..config import GenerationConfig
from .example import EvalExample


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
    """Digest of an example's content (prompt ids, references, lengths, metadata): rows of an id
    whose content changed are refused on resume."""
    return _digest(dict(dataset=e.dataset, ids=[int(x) for x in e.ids], answers=e.answers,
                        max_new_tokens=e.max_new_tokens, kind=e.kind, meta=e.meta))


def policy_repr(policy) -> str:
    """The policy's repr (a frozen dataclass: every knob); other objects: class and attributes."""
    if dataclasses.is_dataclass(policy) or not hasattr(policy, "__dict__"):
        return repr(policy)
    return f"{type(policy).__qualname__}({', '.join(f'{k}={v!r}' for k, v in sorted(vars(policy).items()))})"
