"""The lowering matrix (every platform x shape x prompt length x mesh x policy, `lower_matrix`),
its summary lines, and the known failures (.ci/lower_known_failures.txt) that are reported but
do not fail a run."""
from __future__ import annotations

from typing import Optional, Sequence

from .cases import CAPACITY, OUT_LEN, default_policies
from .lower import lower_case

def lower_matrix(platforms: Sequence[str], shapes: Sequence[str], prompt_lens: Sequence[int],
                 policies: Optional[Sequence[str]] = None, meshes: Sequence[Optional[str]] = (None,),
                 batch: Optional[int] = None, out_len: int = OUT_LEN, capacity: float = CAPACITY,
                 log=None) -> list[dict]:
    """Every (platform, shape, prompt length, policy, mesh) case lowered (lower_case); policies
    None: each shape's DEFAULT_POLICIES."""
    rows = []
    for shape in shapes:
        for n in prompt_lens:
            for mesh in meshes:
                for pol in (policies or default_policies(shape)):
                    for plat in platforms:
                        row = lower_case(shape, plat, pol, n, mesh, batch, out_len, capacity)
                        rows.append(row)
                        if log is not None:
                            print(f"[lower] {summary_line(row)}", file=log, flush=True)
    return rows


def summary_line(r: dict) -> str:
    """One row as one line of the log: lowered (kernel calls, size, seconds), skipped or FAILED."""
    head = f"{r['platform']:4s} {r['shape']:15s} {r['policy']:20s} {r['mesh'] or '1 device':15s} {r['prompt_len']:6d}"
    if r["skipped"]:
        return f"{head}  skipped: {r['skipped']}"
    if r["lowered"]:
        return (f"{head}  lowered  {r['kernel_calls']:3d} kernel calls  {r['stablehlo_chars'] / 1e6:6.2f} M chars  "
                f"{r['seconds']:6.1f} s")
    return f"{head}  FAILED   {r['error']}"


def matrix_summary(rows: Sequence[dict]) -> str:
    """The run in one line: lowered, failed (known), skipped, lowered without a kernel call, time."""
    ok = [r for r in rows if r["lowered"]]
    bad = [r for r in rows if not r["lowered"] and not r["skipped"]]
    skip = [r for r in rows if r["skipped"]]
    known = [r for r in bad if r.get("known_failure")]
    fixed = [r for r in ok if r.get("known_failure_fixed")]
    no_kernels = [r for r in ok if r["kernel_calls"] == 0]
    return (f"{len(ok)} of {len(rows) - len(skip)} cases lowered ({len(bad)} failed, {len(known)} of them known; "
            f"{len(skip)} skipped), {len(no_kernels)} lowered without a kernel call, "
            f"{sum(r['seconds'] for r in rows):.0f} s" + (f"; {len(fixed)} known failures now lower" if fixed else ""))


def read_known_failures(path: str) -> list[tuple]:
    """Lines "platform shape policy mesh  reason" (fnmatch patterns; mesh "none": one device;
    # comments) -> [(patterns, reason)]."""
    out = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split(None, 4)
            if len(parts) < 5:
                raise ValueError(f"{path}:{i}: expected 'platform shape policy mesh reason', got {line!r}")
            out.append((tuple(parts[:4]), parts[4]))
    return out


def mark_known_failures(rows: Sequence[dict], known: Sequence[tuple]) -> None:
    """Set row["known_failure"] (the reason) on the failed rows a known-failure line matches, and
    row["known_failure_fixed"] on the lowered ones it matches (the line can go)."""
    from fnmatch import fnmatchcase

    for r in rows:
        key = (r["platform"], r["shape"], r["policy"], r["mesh"] or "none")
        for pats, why in known:
            if all(fnmatchcase(k, p) for k, p in zip(key, pats)):
                if r["lowered"]:
                    r["known_failure_fixed"] = why
                elif not r["skipped"]:
                    r["known_failure"] = why
                break


def unexpected_failures(rows: Sequence[dict]) -> list[dict]:
    """The failed rows no known-failure line matches (what fails `maskahead lower`)."""
    return [r for r in rows if not r["lowered"] and not r["skipped"] and not r.get("known_failure")]
