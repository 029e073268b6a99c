"""`maskahead profile`: prefill / decode / end-to-end time, peak KV and serving capacity per policy."""
from __future__ import annotations

import json
import os
import sys

from .args import capacity_arg, check_out_file, csv_list, pos_float, pos_int, pos_ints
from .common import (add_mesh_arg, add_model_args, gen_config, init_mesh, load_model, model_config, model_path,
                     policy_kw_arg, with_rope_flags)
from .errors import EXIT_FAILED, EXIT_OK, CLIError, one_line


def add_parser(sub, known: str) -> None:
    """`maskahead profile`'s options (known: the registered policy names, for --help)."""
    p = sub.add_parser("profile", help="systems profile (prefill / decode / e2e, peak KV, serving capacity)")
    add_model_args(p)
    p.add_argument("--shape", default=None, help="random-weight real-model shape: fast-dllm-v2-7b, sdar-8b, llada-8b, llada2-mini")
    p.add_argument("--layers", type=pos_int, default=None, help="with --shape: use fewer layers (smoke runs)")
    p.add_argument("--prompt-len", type=pos_int, default=1024)
    p.add_argument("--out-len", type=pos_int, default=256)
    p.add_argument("--batch", default="1", help="batch sizes, comma-separated")
    p.add_argument("--policies", default="dense,maskahead,q-maskahead", help=f"comma-separated, from: {known}")
    p.add_argument("--capacity", type=capacity_arg, default=10.0)
    p.add_argument("--repeats", type=pos_int, default=1)
    p.add_argument("--kv-budget-gb", type=pos_float, default=40.0, help="KV memory budget for serving capacity")
    add_mesh_arg(p)
    p.add_argument("--out", default=None, help="write the full result as JSON to this file (atomically); "
                                                "stdout gets a table")
    p.add_argument("--json", action="store_true", help="print the JSON on stdout instead of the table")
    p.set_defaults(run=run)


def run(args) -> int:
    """The systems profile of policies at one prompt length and several batch sizes."""
    from .. import profile as PR

    if args.out:
        check_out_file(args.out)
    init_mesh(args)  # before anything touches a JAX backend (multi-process runs)
    batches = pos_ints(args.batch, "--batch")
    policies = csv_list(args.policies)
    kw = policy_kw_arg(args.policy_kw)
    if args.shape:
        cfg = PR.shape_config(args.shape, args.layers)
        cfg = with_rope_flags(cfg, args)
        label = args.shape + (f" ({args.layers} layers)" if args.layers else "")
        if args.preset is None:
            args.preset = PR.SHAPE_PRESET.get(args.shape.lower())
    else:
        label = model_path(args.model)
        cfg = model_config(label, args.family, args)
    gen = gen_config(args)
    bs = gen.block_size or cfg.block_size
    if args.out_len <= bs:
        raise CLIError(f"--out-len {args.out_len} must exceed one block ({bs}) to split prefill and decode")
    if not policies:
        raise CLIError("no policies given")
    PR.build_policies(cfg, gen, policies, args.capacity, args.out_len, kw)  # refuse before the load

    if args.shape:
        model = PR.random_model(cfg, dtype=args.dtype or "bfloat16")
    else:
        from ..api import Model

        model, _ = load_model(label, args.dtype, args.family, args)
        model = Model(cfg, model.params)
    res = PR.profile(model, args.prompt_len, args.out_len, batches, policies,
                     capacity=args.capacity, gen=gen, repeats=args.repeats, policy_kw=kw,
                     kv_budget_gb=args.kv_budget_gb, mesh=args.mesh)
    res["model"] = label if args.shape or not args.model else args.model
    if res["model"] != label:  # a hub id: where it was read from
        res["model_folder"] = label
    res["preset"] = args.preset
    text = json.dumps(res, indent=1)
    if args.out:
        from ..evaluation.atomic import write_text

        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        write_text(args.out, text)
    if args.json:
        print(text)
    else:
        print(PR.format_table(res))
        print(f"\nJSON (every field): {args.out}" if args.out else
              "\n(every field as JSON: --out FILE.json writes it, --json prints it instead of this table)")
    if res["skipped"]:
        for sk in res["skipped"]:
            print(f"maskahead profile: run {sk['policy']} batch {sk.get('batch')} failed: "
                  f"{one_line(sk['reason'])}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK
