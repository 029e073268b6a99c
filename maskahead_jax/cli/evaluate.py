"""`maskahead eval`: policies x budgets over the testbed suite, needle grids, LongBench, math and RULER."""
from __future__ import annotations

import json
import os
import sys
from typing import Optional

from .args import check_out_dir, csv_list, parse_depths, pos_int, pos_ints
from .common import (add_mesh_arg, add_model_args, build_run_policies, gen_config, init_mesh, load_model,
                     model_config, model_path, policy_kw_arg)
from .errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, CLIError, one_line


def add_parser(sub, known: str) -> None:
    """`maskahead eval`'s options (known: the registered policy names, for --help)."""
    p = sub.add_parser("eval", help="policies x budgets sweep")
    add_model_args(p)
    p.add_argument("--policies", default=None, help=f"comma-separated, from: {known} (default dense,maskahead)")
    p.add_argument("--capacity", default=None, help="comma-separated %% budgets, p.g. 5,10,20 (default 10)")
    p.add_argument("--out", required=True, help="output folder (results.jsonl, summary.md/json, *.png)")
    p.add_argument("--batch-size", type=pos_int, default=None, help="default 8 (a --sweep: its own)")
    p.add_argument("--sweep", default=None,
                   help="a whole named sweep instead of --suite/--policies/--capacity/--preset: "
                        "testbed-policies = docs/results.md §2 (the five testbed tasks at 2048 tokens x 2 "
                        "seeds x 5 depths, passkey at 4096 x 1 x 5; dense, maskahead, maskahead-bounded, "
                        "streaming, h2o, caote, snapkv, ea, dapq, mage, herald, pyramidkv, adakv (block_causal=true: the testbed is block-causal), "
                        "q-maskahead[bits=4], q-maskahead[bits=2], q-maskahead[bits=4,compaction=lazy] at 10%%, then 5%%, then 20%%; --preset "
                        "testbed and its floors; batch 4). Resumes like any eval: rerun the same command")
    p.add_argument("--bucket", default="auto",
                   help="prompt-length bucket quantum in tokens, or auto (<= 12.5%% padding)")
    p.add_argument("--max-new-tokens", type=pos_int, default=None, help="override the per-dataset lengths")
    p.add_argument("--suite", action="store_true", help="the testbed task suite")
    p.add_argument("--tasks", default="passkey,multikey,twohop,docqa,longanswer")
    p.add_argument("--lengths", default="512,1024", help="suite / needle context lengths (tokens)")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths, fractions in [0, 1]")
    p.add_argument("--n", type=pos_int, default=2, help="examples per (task, length, depth) cell")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--needle", action="store_true", help="needle grid (length x depth)")
    p.add_argument("--needle-task", default="passkey", choices=["passkey", "twohop"])
    p.add_argument("--longbench", default=None,
                   help="LongBench v1 JSONL files or folders, LongBench v2 data.json, comma-separated")
    p.add_argument("--longbench-datasets", default=None, help="keep only these datasets (v2: longbench_v2)")
    p.add_argument("--max-length", type=pos_int, default=None,
                   help="LongBench middle-truncation length (default: model positions - max new - 2 blocks)")
    p.add_argument("--no-chat", action="store_true", help="never apply the chat template")
    p.add_argument("--math", action="append", default=[], help="GSM8K / MATH-500 JSONL (repeatable)")
    p.add_argument("--math-max-new-tokens", type=pos_int, default=2048)
    p.add_argument("--limit", type=pos_int, default=None, help="examples per LongBench / math file")
    p.add_argument("--ruler", default=None, metavar="LENGTHS",
                   help="RULER at these total lengths in model tokens (prompt + generation), comma-separated, "
                        "p.g. 4096,8192; generated offline (needs the [ruler] extra)")
    p.add_argument("--ruler-tasks", default=None,
                   help="RULER tasks, comma-separated, or all (default: every task the given data allows: "
                        "niah_single_1, niah_multikey_2, niah_multikey_3, vt, cwe, fwe always; the essay tasks "
                        "with --ruler-haystack; qa_1 / qa_2 with --ruler-qa)")
    p.add_argument("--ruler-haystack", default=None, metavar="TEXT_FILE",
                   help="plain text for RULER's essay haystack (RULER uses Paul Graham's essays; not shipped)")
    p.add_argument("--ruler-qa", default=None, metavar="FILE[,FILE]",
                   help="SQuAD v2 dev JSON (qa_1) and/or HotpotQA dev distractor JSON (qa_2)")
    p.add_argument("--ruler-n", type=pos_int, default=25, help="RULER examples per (task, length)")
    p.add_argument("--strict", action="store_true", help="stop at the first failing policy")
    add_mesh_arg(p)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=run)


def rows_saved(out_dir: str) -> int:
    from ..evaluation.sweep import load_rows

    try:
        return len(load_rows(os.path.join(out_dir, "results.jsonl"), repair=False))
    except (OSError, ValueError):
        return 0


def interrupted_line(out_dir: str) -> str:
    """What an interrupted eval says: how many rows are saved where, and how to resume."""
    return (f"maskahead eval: interrupted; {rows_saved(out_dir)} rows saved in "
            f"{os.path.join(out_dir, 'results.jsonl')}, rerun the same command to resume")


def run(args) -> int:
    """An evaluation: examples x policies x budgets, resumable (docs/evaluation.md)."""
    from ..evaluation import datasets as D
    from ..evaluation.policies import parse_capacities
    from ..evaluation.sweep import run_sweep

    # everything that can be refused is checked before the model's weights are loaded
    check_out_dir(args.out)
    init_mesh(args)  # before anything touches a JAX backend (multi-process runs)
    if args.sweep:
        return run_sweep_preset(args)
    if not (args.suite or args.needle or args.longbench or args.math or args.ruler):
        raise CLIError("no examples: pass --suite, --needle, --longbench PATHS, --math FILE and/or --ruler LENGTHS")
    args.policies = args.policies or "dense,maskahead"
    args.capacity = args.capacity or "10"
    args.batch_size = args.batch_size or 8
    lengths = pos_ints(args.lengths, "--lengths") if args.suite or args.needle else []
    depths = parse_depths(args.depths) if args.suite or args.needle else []
    bucket = args.bucket if args.bucket == "auto" else pos_ints(args.bucket, "--bucket")[0]
    policies = csv_list(args.policies)
    caps = parse_capacities(args.capacity)
    kw = policy_kw_arg(args.policy_kw)
    path = model_path(args.model)
    cfg = model_config(path, args.family, args)
    gen = gen_config(args)
    factory, _ = build_run_policies(cfg, gen, policies, caps, kw, args.max_new_tokens, args.preset)

    ruler = ruler_setup(args, cfg) if args.ruler else None  # refused before the tokenizer loads
    tok = D.load_tokenizer(path)
    exs, dataset = examples(args, cfg, gen, tok, ruler, lengths, depths)
    if not exs:
        raise CLIError("no examples: the data files given hold none (or --longbench-datasets kept none)")
    check_positions(exs, cfg, gen, args.max_new_tokens)

    model, path = load_model(path, args.dtype, args.family, args)
    print(f"[eval] {len(exs)} examples x {len(policies)} policies x {len(caps)} capacities -> {args.out}",
          file=sys.stderr)
    try:
        res = run_sweep(model, exs, policies, caps, args.out, tok, gen=gen, batch_size=args.batch_size,
                        max_new_tokens=args.max_new_tokens, progress=not args.no_progress, strict=args.strict,
                        plots=not args.no_plots, policy_factory=factory, bucket=bucket,
                        meta=dict(model=path, preset=args.preset, argv=sys.argv[1:],
                                  **({"hub_id": args.model} if args.model and args.model != path else {})),
                        mesh=args.mesh,
                        model_path=os.path.realpath(path), dataset=dataset)
    except KeyboardInterrupt:
        print("\n" + interrupted_line(args.out), file=sys.stderr)
        return EXIT_INTERRUPTED
    return report(res)


def examples(args, cfg, gen, tok, ruler: Optional[dict], lengths: list, depths: list) -> tuple:
    """The run's examples from --suite / --needle / --longbench / --math / --ruler, and the dataset
    options of the run fingerprint (with the model and generation settings: run.json)."""
    from ..evaluation import datasets as D

    exs = []
    dataset = {}
    if args.suite:
        exs += D.testbed_suite(csv_list(args.tasks), lengths, depths, n_per_cell=args.n, seed=args.seed, tokenizer=tok)
        dataset["suite"] = dict(tasks=csv_list(args.tasks), lengths=lengths, depths=depths, n=args.n, seed=args.seed)
    if args.needle:
        exs += D.needle_grid(lengths, depths, n_per_cell=args.n, seed=args.seed, task=args.needle_task,
                             tokenizer=tok)
        dataset["needle"] = dict(task=args.needle_task, lengths=lengths, depths=depths, n=args.n, seed=args.seed)
    if args.longbench:
        bs = gen.block_size or cfg.block_size
        max_len = args.max_length or (cfg.max_position_embeddings - 512 - 2 * bs)
        if max_len <= 0:
            raise CLIError(f"the model's {cfg.max_position_embeddings} positions leave no room for a LongBench "
                           f"prompt; pass --max-length")
        ds = csv_list(args.longbench_datasets) if args.longbench_datasets else None
        exs += D.load_longbench(args.longbench, tok, max_len, datasets=ds, limit=args.limit,
                                chat=False if args.no_chat else None)
        dataset["longbench"] = dict(paths=[os.path.abspath(x) for x in csv_list(args.longbench)], datasets=ds,
                                    max_length=max_len, limit=args.limit, no_chat=args.no_chat)
    for m in args.math:
        exs += D.load_math(m, tok, limit=args.limit, max_new_tokens=args.math_max_new_tokens,
                           chat=not args.no_chat)
    if args.math:
        dataset["math"] = dict(paths=[os.path.abspath(x) for x in args.math], limit=args.limit,
                               max_new_tokens=args.math_max_new_tokens, no_chat=args.no_chat)
    if ruler:
        from ..evaluation.ruler import ruler_examples

        exs += ruler_examples(ruler["tasks"], ruler["lengths"], tok, args.ruler_n, ruler.pop("sources"),
                              seed=args.seed, chat=not args.no_chat)
        dataset["ruler"] = ruler
    return exs, dataset


def check_positions(exs, cfg, gen, max_new: Optional[int]) -> None:
    """Every example's prompt + new tokens + one block within the model's positions (generate's
    own check), up front: the suite / needle lengths, math and LongBench prompts."""
    bs = gen.block_size or cfg.block_size
    over = [e for e in exs if len(e.ids) + (max_new or e.max_new_tokens) + bs > cfg.max_position_embeddings]
    if over:
        e = max(over, key=lambda x: len(x.ids) + (max_new or x.max_new_tokens))
        lengths = sorted({x.meta["length"] for x in over if x.kind == "testbed"})  # suite / needle lengths
        what = f"--lengths {','.join(map(str, lengths))}: " if lengths else ""
        raise CLIError(f"{what}{len(over)} example{'s' if len(over) > 1 else ''} beyond the model's "
                       f"{cfg.max_position_embeddings} positions (e.g. {e.id}: {len(e.ids)} prompt tokens + "
                       f"{max_new or e.max_new_tokens} new + a block of {bs})")


def ruler_setup(args, cfg) -> dict:
    """RULER's options checked up front (lengths within the model's positions, tasks, local files,
    wonderwords), the local files read; returns the run-fingerprint entry with the sources."""
    from ..evaluation import ruler as R

    lengths = pos_ints(args.ruler, "--ruler")
    too_long = [n for n in lengths if n > cfg.max_position_embeddings]
    if too_long:
        raise CLIError(f"--ruler {','.join(map(str, too_long))}: beyond the model's "
                       f"{cfg.max_position_embeddings} positions")
    qa_paths = csv_list(args.ruler_qa) if args.ruler_qa else []
    sources = R.load_sources(args.ruler_haystack, qa_paths)
    if args.ruler_tasks in (None, ""):
        tasks = R.available_tasks(sources)
        skipped = [t for t in R.TASK_NAMES if t not in tasks]
        if skipped:
            print(f"[eval] RULER: skipping {', '.join(skipped)} (no --ruler-haystack / --ruler-qa data for them)",
                  file=sys.stderr)
    else:
        tasks = list(R.TASK_NAMES) if args.ruler_tasks == "all" else csv_list(args.ruler_tasks)
    R.check_tasks(tasks, sources)
    files = ([args.ruler_haystack] if args.ruler_haystack else []) + qa_paths
    return dict(tasks=tasks, lengths=lengths, n=args.ruler_n, seed=args.seed, no_chat=args.no_chat,
                generator=R.GENERATOR_VERSION,
                files=[dict(path=os.path.abspath(f), sha256=R.file_digest(f)) for f in files], sources=sources)


def run_sweep_preset(args) -> int:
    """`maskahead eval --sweep NAME`: a named sweep preset (evaluation.presets.SWEEPS) sets the
    examples, policies, budgets, decoding preset and its policy knobs; only the model, --out,
    --batch-size and the progress / plot switches may be given with it."""
    from ..evaluation import datasets as D
    from ..evaluation.presets import sweep_examples, sweep_factory, sweep_preset
    from ..evaluation.sweep import build_policies, run_sweep

    try:
        sp = sweep_preset(args.sweep)
    except ValueError as e:
        raise CLIError(f"--sweep: {e}") from None
    clash = [f for f, v in (("--suite", args.suite), ("--needle", args.needle), ("--longbench", args.longbench),
                            ("--math", args.math), ("--ruler", args.ruler), ("--policies", args.policies),
                            ("--capacity", args.capacity),
                            ("--preset", args.preset), ("--policy-kw", args.policy_kw),
                            ("--threshold", args.threshold), ("--block-size", args.block_size),
                            ("--max-new-tokens", args.max_new_tokens)) if v]
    if clash:
        raise CLIError(f"--sweep {args.sweep} fixes its examples, policies and settings; drop {', '.join(clash)}")
    args.preset = sp.preset
    path = model_path(args.model)
    cfg = model_config(path, args.family, args)
    gen = gen_config(args)
    factory = sweep_factory(sp)
    build_policies(cfg, gen, sp.policies, sp.capacities, factory)  # refuse before loading anything
    tok = D.load_tokenizer(path)
    exs = sweep_examples(sp, tok)
    dataset = dict(sweep=dict(name=args.sweep, cells=[[list(t), ln, n, sfx] for t, ln, n, sfx in sp.cells],
                              depths=list(sp.depths), seed=sp.seed))
    model, path = load_model(path, args.dtype, args.family, args)
    print(f"[eval] sweep {args.sweep}: {len(exs)} examples x {len(sp.policies)} policies x "
          f"{len(sp.capacities)} capacities -> {args.out}", file=sys.stderr)
    try:
        res = run_sweep(model, exs, sp.policies, sp.capacities, args.out, tok, gen=gen,
                        batch_size=args.batch_size or sp.batch_size, progress=not args.no_progress,
                        strict=args.strict, plots=not args.no_plots, policy_factory=factory,
                        bucket="auto" if args.bucket == "auto" else pos_ints(args.bucket, "--bucket")[0],
                        meta=dict(model=path, sweep=args.sweep, argv=sys.argv[1:]), mesh=args.mesh,
                        model_path=os.path.realpath(path), dataset=dataset, score_datasets=sp.score_datasets,
                        order=sp.order)
    except KeyboardInterrupt:
        print("\n" + interrupted_line(args.out), file=sys.stderr)
        return EXIT_INTERRUPTED
    return report(res)


def report(res) -> int:
    with open(res.paths["summary_md"], encoding="utf-8") as f:
        print(f.read())
    print(json.dumps({k: v for k, v in res.paths.items()}, indent=1))
    if res.errors:
        from ..evaluation.sweep import cap_label

        for err in res.errors:
            print(f"maskahead eval: run {err['policy']}@{cap_label(err['capacity'])} failed: "
                  f"{one_line(err['error'])}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK
