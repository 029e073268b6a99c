"""The `maskahead` command: convert, generate, eval, profile, demo.

    maskahead demo
    maskahead generate --prompt "..." --policy maskahead --capacity 10
    maskahead eval --suite --policies dense,maskahead,streaming --capacity 5,10,20 --out runs/eval
    maskahead profile --shape fast-dllm-v2-7b --prompt-len 8192 --out-len 256 --batch 1,8,32
    maskahead convert SRC DST [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional, Sequence

from .config import FAMILY_DEFAULTS

TESTBED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testbed")


class CLIError(Exception):
    pass


def _csv(text, typ=str) -> list:
    try:
        return [typ(x) for x in str(text).split(",") if x.strip() != ""]
    except ValueError:
        raise CLIError(f"cannot parse {text!r} as a comma-separated list of {typ.__name__}") from None


def _load(path: Optional[str], dtype: Optional[str] = None, family: Optional[str] = None):
    from .api import load_pretrained

    path = path or TESTBED
    if not os.path.isdir(path):
        raise CLIError(f"model folder not found: {path}")
    return load_pretrained(path, dtype=dtype, family=family), path


def _gen(args, max_new: int = 64):
    from .evaluation.presets import preset_config

    return preset_config(getattr(args, "preset", None), max_new_tokens=max_new,
                         threshold=getattr(args, "threshold", None),
                         block_size=getattr(args, "block_size", None))


def _kw(text) -> dict:
    """'capacity_floor=128,topk_floor=32' -> {'capacity_floor': 128, 'topk_floor': 32}."""
    from .evaluation.policies import parse_policy_kw

    try:
        return parse_policy_kw(text)
    except ValueError as e:
        raise CLIError(str(e)) from None


def _factory(kw: dict):
    from .evaluation.policies import make_policy

    return lambda name, cap: make_policy(name, cap, **({} if name == "dense" else kw))


def _add_model(p, default_testbed=True):
    p.add_argument("--model", default=None,
                   help="model folder (HF layout or converted); default: the shipped testbed" if default_testbed
                   else "model folder")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--family", default=None, choices=sorted(FAMILY_DEFAULTS),
                   help="force the model family (default: from config.json; a plain autoregressive "
                        "qwen2 / qwen3 config is refused without it)")
    p.add_argument("--preset", default=None,
                   help="decoding preset: fast-dllm-v2, dream-reasoner, sdar, llada2-mini, llada, dream, testbed")
    p.add_argument("--threshold", type=float, default=None, help="override the commit threshold")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--policy-kw", default=None,
                   help="policy knobs passed to policies.make, e.g. capacity_floor=128,topk_floor=32")


def _add_mesh(parser) -> None:
    parser.add_argument("--mesh", default=None,
                        help="device mesh, e.g. data=2,model=4 or seq=4 (docs/sharding.md); multi-process: "
                             "set the MASKAHEAD_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID env vars")


def _init_mesh(args) -> None:
    if getattr(args, "mesh", None):
        from .distributed import initialize
        initialize(required=False)  # multi-process when MASKAHEAD_* env vars are set


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="maskahead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("convert", add_help=False, help="HF checkpoint -> orbax folder (see `maskahead convert -h`)")

    g = sub.add_parser("generate", help="generate for one prompt")
    _add_model(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (encoded with the model folder's tokenizer)")
    src.add_argument("--ids", help="prompt token ids, comma-separated")
    g.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    g.add_argument("--policy", default="dense")
    g.add_argument("--capacity", type=float, default=10.0, help="KV capacity, %% of tokens seen")
    g.add_argument("--max-new-tokens", type=int, default=32)
    _add_mesh(g)

    e = sub.add_parser("eval", help="policies x budgets sweep")
    _add_model(e)
    e.add_argument("--policies", default="dense,maskahead")
    e.add_argument("--capacity", default="10", help="comma-separated %% budgets, e.g. 5,10,20")
    e.add_argument("--out", required=True, help="output folder (results.jsonl, summary.md/json, *.png)")
    e.add_argument("--batch-size", type=int, default=8)
    e.add_argument("--bucket", default="auto",
                   help="prompt-length bucket quantum in tokens, or auto (<= 12.5%% padding)")
    e.add_argument("--max-new-tokens", type=int, default=None, help="override the per-dataset lengths")
    e.add_argument("--suite", action="store_true", help="the testbed task suite")
    e.add_argument("--tasks", default="passkey,multikey,twohop,docqa,longanswer")
    e.add_argument("--lengths", default="512,1024", help="suite / needle context lengths (tokens)")
    e.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    e.add_argument("--n", type=int, default=2, help="examples per (task, length, depth) cell")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--needle", action="store_true", help="needle grid (length x depth)")
    e.add_argument("--needle-task", default="passkey", choices=["passkey", "twohop"])
    e.add_argument("--longbench", default=None, help="LongBench JSONL files or folders, comma-separated")
    e.add_argument("--longbench-datasets", default=None, help="keep only these datasets")
    e.add_argument("--max-length", type=int, default=None,
                   help="LongBench middle-truncation length (default: model positions - max new - 2 blocks)")
    e.add_argument("--no-chat", action="store_true", help="never apply the chat template")
    e.add_argument("--math", action="append", default=[], help="GSM8K / MATH-500 JSONL (repeatable)")
    e.add_argument("--math-max-new-tokens", type=int, default=2048)
    e.add_argument("--limit", type=int, default=None, help="examples per LongBench / math file")
    e.add_argument("--strict", action="store_true", help="stop at the first failing policy")
    _add_mesh(e)
    e.add_argument("--no-plots", action="store_true")
    e.add_argument("--no-progress", action="store_true")

    p = sub.add_parser("profile", help="systems profile (prefill / decode / e2e, peak KV, serving capacity)")
    _add_model(p)
    p.add_argument("--shape", default=None, help="random-weight real-model shape: fast-dllm-v2-7b, sdar-8b, llada2-mini")
    p.add_argument("--layers", type=int, default=None, help="with --shape: use fewer layers (smoke runs)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--out-len", type=int, default=256)
    p.add_argument("--batch", default="1", help="batch sizes, comma-separated")
    p.add_argument("--policies", default="dense,maskahead,q-maskahead")
    p.add_argument("--capacity", type=float, default=10.0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--kv-budget-gb", type=float, default=40.0, help="KV memory budget for serving capacity")
    _add_mesh(p)
    p.add_argument("--max-positions", type=int, default=None,
                   help="override the model's max_position_embeddings (timing runs beyond the trained range)")
    p.add_argument("--out", default=None, help="also write the JSON here")

    d = sub.add_parser("demo", help="testbed needle prompts: dense vs MaskAhead side by side")
    d.add_argument("--tasks", default="passkey,multikey",
                   help="testbed tasks to draw the prompts from (one per depth each), comma-separated")
    d.add_argument("--length", type=int, default=512)
    d.add_argument("--depths", default="0.25,0.75")
    d.add_argument("--capacity", type=float, default=10.0)
    d.add_argument("--policy", default="maskahead",
                   help="the policies to compare with dense, comma-separated (e.g. maskahead,q-maskahead)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--policy-kw", default="capacity_floor=128,topk_floor=32",
                   help="knobs for the compared policy (the paper's floors, 512 / 256, exceed the "
                        "testbed's short prompts); falls back to the policy defaults if rejected")
    return ap


# ----------------------------------------------------------------------------- commands
def cmd_generate(args) -> int:
    from .evaluation.datasets import load_tokenizer
    from .evaluation.policies import make_policy
    from .generate import generate

    _init_mesh(args)
    model, path = _load(args.model, args.dtype, args.family)
    tok = load_tokenizer(path)
    if args.ids is not None:
        ids = _csv(args.ids, int)
        if not ids:
            raise CLIError("--ids is empty")
    else:
        ids = tok.encode_prompt(args.prompt, chat=args.chat)
    policy = _factory(_kw(args.policy_kw))(args.policy, args.capacity)
    out = generate(model, [ids], _gen(args, args.max_new_tokens), policy, mesh=args.mesh or None)
    st = out.stats
    print(json.dumps(dict(
        text=tok.decode(out.tokens[0]), tokens=out.tokens[0], policy=args.policy,
        capacity=None if args.policy == "dense" else args.capacity, prompt_tokens=len(ids),
        nfe=st["nfe"][0], reduction_final=st["reduction_final"][0], reduction_peak=st["reduction_peak"][0],
        kv_bytes_peak=st["kv_bytes_peak"][0], wall_s=st["wall_s"]), indent=1))
    return 0


def cmd_eval(args) -> int:
    from .evaluation import datasets as D
    from .evaluation.policies import parse_capacities
    from .evaluation.sweep import run_sweep

    model, path = _load(args.model, args.dtype, args.family)
    tok = D.load_tokenizer(path)
    exs = []
    if args.suite:
        exs += D.testbed_suite(_csv(args.tasks), _csv(args.lengths, int), _csv(args.depths, float),
                               n_per_cell=args.n, seed=args.seed, tokenizer=tok)
    if args.needle:
        exs += D.needle_grid(_csv(args.lengths, int), _csv(args.depths, float), n_per_cell=args.n,
                             seed=args.seed, task=args.needle_task, tokenizer=tok)
    gen = _gen(args)
    # the dataset options of the run fingerprint (with the model and generation settings: run.json)
    dataset = {}
    if args.suite:
        dataset["suite"] = dict(tasks=_csv(args.tasks), lengths=_csv(args.lengths, int),
                                depths=_csv(args.depths, float), n=args.n, seed=args.seed)
    if args.needle:
        dataset["needle"] = dict(task=args.needle_task, lengths=_csv(args.lengths, int),
                                 depths=_csv(args.depths, float), n=args.n, seed=args.seed)
    if args.longbench:
        bs = gen.block_size or model.config.block_size
        max_len = args.max_length or (model.config.max_position_embeddings - 512 - 2 * bs)
        ds = _csv(args.longbench_datasets) if args.longbench_datasets else None
        exs += D.load_longbench(args.longbench, tok, max_len, datasets=ds, limit=args.limit,
                                chat=False if args.no_chat else None)
        dataset["longbench"] = dict(paths=[os.path.abspath(x) for x in _csv(args.longbench)], datasets=ds,
                                    max_length=max_len, limit=args.limit, no_chat=args.no_chat)
    for m in args.math:
        exs += D.load_math(m, tok, limit=args.limit, max_new_tokens=args.math_max_new_tokens,
                           chat=not args.no_chat)
    if args.math:
        dataset["math"] = dict(paths=[os.path.abspath(x) for x in args.math], limit=args.limit,
                               max_new_tokens=args.math_max_new_tokens, no_chat=args.no_chat)
    if not exs:
        raise CLIError("no examples: pass --suite, --needle, --longbench PATHS and/or --math FILE")
    policies = _csv(args.policies)
    caps = parse_capacities(args.capacity)
    print(f"[eval] {len(exs)} examples x {len(policies)} policies x {len(caps)} capacities -> {args.out}",
          file=sys.stderr)
    res = run_sweep(model, exs, policies, caps, args.out, tok, gen=gen, batch_size=args.batch_size,
                    max_new_tokens=args.max_new_tokens, progress=not args.no_progress, strict=args.strict,
                    plots=not args.no_plots, policy_factory=_factory(_kw(args.policy_kw)),
                    bucket=args.bucket if args.bucket == "auto" else _csv(args.bucket, int)[0],
                    meta=dict(model=path, preset=args.preset, argv=sys.argv[1:]), mesh=args.mesh,
                    model_path=os.path.realpath(path), dataset=dataset)
    print(open(res.paths["summary_md"]).read())
    print(json.dumps({k: v for k, v in res.paths.items()}, indent=1))
    return 1 if res.errors and args.strict else 0


def cmd_profile(args) -> int:
    from . import profile as PR

    _init_mesh(args)
    if args.shape:
        cfg = PR.shape_config(args.shape, args.layers)
        model = PR.random_model(cfg, dtype=args.dtype or "bfloat16")
        label = args.shape + (f" ({args.layers} layers)" if args.layers else "")
        if args.preset is None:
            args.preset = PR.SHAPE_PRESET.get(args.shape.lower())
    else:
        model, label = _load(args.model, args.dtype, args.family)
    if args.max_positions:
        from .api import Model

        model = Model(model.config.replace(max_position_embeddings=args.max_positions), model.params)
    res = PR.profile(model, args.prompt_len, args.out_len, _csv(args.batch, int), _csv(args.policies),
                     capacity=args.capacity, gen=_gen(args), repeats=args.repeats,
                     policy_kw=_kw(args.policy_kw),
                     kv_budget_gb=args.kv_budget_gb, mesh=args.mesh)
    res["model"] = label
    res["preset"] = args.preset
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    return 0


def cmd_demo(args) -> int:
    from .evaluation.datasets import load_tokenizer, score_example, testbed_suite
    from .evaluation.policies import PolicyError, make_policy
    from .generate import generate

    t_start = time.perf_counter()
    model, path = _load(None)
    tok = load_tokenizer(path)
    exs = testbed_suite(_csv(args.tasks), [args.length], _csv(args.depths, float), n_per_cell=1,
                        seed=args.seed, tokenizer=tok)
    cfg = _gen(argparse.Namespace(preset=None), max_new=max(e.max_new_tokens for e in exs))
    runs = [("dense", make_policy("dense"))]
    notes = []
    for name in _csv(args.policy):
        try:
            try:
                pol = make_policy(name, args.capacity, **_kw(args.policy_kw))
            except PolicyError:
                pol = make_policy(name, args.capacity)
            runs.append((name, pol))
        except PolicyError as e:
            notes.append(f"note: {name} is not available here ({e}); skipped.")
    if len(runs) == 1:
        notes.append("note: showing the dense cache only.")
    print(f"MaskAhead demo: testbed model ({path}), tasks {args.tasks}, {args.length}-token prompts, "
          f"depths {args.depths}, capacity {args.capacity:g}%")
    for n in notes:
        print(n)
    results = {}
    for name, pol in runs:
        ids = [e.ids for e in exs]
        generate(model, ids, cfg, pol)  # compile
        out = generate(model, ids, cfg, pol)
        results[name] = out
    w = max(len(n) for n, _ in runs) + 2
    for i, e in enumerate(exs):
        print(f"\n {e.meta['task']}  depth {e.meta['depth']:.2f}  answer {e.answers[0]}")
        for name, _ in runs:
            pred = tok.decode(results[name].tokens[i])
            ok = score_example(e, pred) >= 1.0
            print(f"   {name:<{w}} {'OK ' if ok else 'XX '} {pred!r}")
    print()
    for name, _ in runs:
        st = results[name].stats
        n_ok = sum(score_example(e, tok.decode(t)) >= 1.0 for e, t in zip(exs, results[name].tokens))
        print(f" {name:<{w}} correct {n_ok}/{len(exs)}  KV reduction end {min(st['reduction_final']):.2f}x "
              f"peak {min(st['reduction_peak']):.2f}x  forwards {st['nfe_batch']}  "
              f"{st['wall_s'] * 1e3:.0f} ms (after compile)")
    print(f"\n total {time.perf_counter() - t_start:.1f}s")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "convert":
        from converters.load import cli_convert

        return cli_convert(argv[1:])
    args = build_parser().parse_args(argv)
    from .config import ConfigError
    from .evaluation.policies import PolicyError

    fn = dict(generate=cmd_generate, eval=cmd_eval, profile=cmd_profile, demo=cmd_demo)[args.cmd]
    try:
        return fn(args)
    except (CLIError, PolicyError, ConfigError, FileNotFoundError, ValueError) as e:
        print(f"maskahead {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
