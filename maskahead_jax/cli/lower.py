"""`maskahead lower`: the generate programs lowered for TPU / CUDA without a device, and the memory plan."""
from __future__ import annotations

import json
import sys

from .args import capacity_arg, csv_list, pos_int, pos_ints
from .errors import EXIT_FAILED, EXIT_OK, CLIError


def add_parser(sub, known: str) -> None:
    """`maskahead lower`'s options (known: the registered policy names, for --help)."""
    p = sub.add_parser("lower", help="lower the generate programs for TPU / CUDA without a device (and --plan: "
                                      "the per-device memory plan)")
    add_arguments(p)
    p.set_defaults(run=run)


def add_arguments(p) -> None:
    p.add_argument("--platform", default="tpu,cuda", help="tpu, cuda or both, comma-separated (lowering only)")
    p.add_argument("--shape", default="fast-dllm-v2-7b",
                   help="model shapes, comma-separated, or all: fast-dllm-v2-7b, sdar-8b, llada-8b, llada2-mini")
    p.add_argument("--prompt-len", default="8192", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--policies", default="default",
                   help="comma-separated, name or name[knob=value,...] (default: dense, maskahead, "
                        "q-maskahead[bits=4], q-maskahead[bits=2] on block-causal shapes; dense, maskkv on "
                        "bidirectional ones)")
    p.add_argument("--mesh", action="append", default=None,
                   help="device mesh, e.g. data=2,model=4 (abstract: no devices needed), or none (one device); "
                        "repeat for several (default: none)")
    p.add_argument("--batch", default=None,
                   help="batch sizes, comma-separated (default: the mesh's data size; --plan: 1,8,32)")
    p.add_argument("--out-len", type=pos_int, default=256, help="new tokens per prompt")
    p.add_argument("--capacity", type=capacity_arg, default=10.0, help="budget of the evicting policies, %%")
    p.add_argument("--plan", action="store_true",
                   help="the per-device memory plan on 8 chips (mesh seq=2,model=4 at batch 1, data=2,model=4 "
                        "otherwise: params, KV accounting and buffers, XLA's buffer plan of a CPU compile) and the "
                        "largest batch per accelerator, instead of lowering (docs/sharding.md)")
    p.add_argument("--no-compile", action="store_true", help="--plan without the CPU compiles (no XLA temp)")
    p.add_argument("--compile-cache", default=None, metavar="FILE",
                   help="--plan: JSON lines of the CPU compiles' buffer plans, reused and extended (they are "
                        "deterministic per case)")
    p.add_argument("--known-failures", default=None, metavar="FILE",
                   help="lines 'platform shape policy mesh reason' (fnmatch patterns, mesh none = one device): "
                        "matching failures are reported but do not fail the run (.ci/lower_known_failures.txt)")
    p.add_argument("--json", action="store_true", help="print the JSON instead of the table")


def run(args) -> int:
    """Lower the generate programs (or --plan: the memory plan); exit 1 on an unexpected failure."""
    from .. import lowering as LW

    shapes = LW.shape_names(args.shape)
    lens = pos_ints(args.prompt_len, "--prompt-len")
    batches = pos_ints(args.batch, "--batch") if args.batch else None
    pols = None if args.policies.strip() == "default" else [x.strip() for x in split_items(args.policies) if x.strip()]
    if args.plan:
        if len(shapes) != 1:
            raise CLIError("--plan takes one --shape")
        plan = LW.memory_plan(shapes[0], lens, batches or (1, 8, 32), pols, args.out_len, args.capacity,
                              compile_temps=not args.no_compile, cache_file=args.compile_cache, log=sys.stderr)
        print(json.dumps(plan, indent=1) if args.json else LW.plan_table(plan))
        return EXIT_FAILED if any("xla_error" in r for r in plan["rows"]) else EXIT_OK
    plats = csv_list(args.platform)
    bad = [x for x in plats if x not in LW.TARGETS]
    if bad or not plats:
        raise CLIError(f"--platform {args.platform!r}: choose from {', '.join(LW.TARGETS)}")
    meshes = [None if m.strip().lower() in ("", "none", "1") else m for m in (args.mesh or ["none"])]
    for m in meshes:
        LW.mesh_sizes_of(m)  # a bad spec: ValueError, before any lowering
    known = LW.read_known_failures(args.known_failures) if args.known_failures else []
    rows = []
    for b in (batches or [None]):
        rows += LW.lower_matrix(plats, shapes, lens, pols, meshes, b, args.out_len, args.capacity,
                                log=sys.stderr if args.json else sys.stdout)
    LW.mark_known_failures(rows, known)
    if args.json:
        print(json.dumps(rows, indent=1))
    print(f"maskahead lower: {LW.matrix_summary(rows)}", file=sys.stderr)
    return EXIT_FAILED if LW.unexpected_failures(rows) else EXIT_OK


def split_items(text: str) -> list:
    from ..evaluation.policies import split_items

    return split_items(text)
