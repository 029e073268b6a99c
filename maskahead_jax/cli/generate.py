"""`maskahead generate`: one prompt through the engine, its text and KV statistics as JSON."""
from __future__ import annotations

import json

from .args import capacity_arg, csv_list, pos_int
from .common import (add_mesh_arg, add_model_args, build_run_policies, gen_config, init_mesh, load_model,
                     model_config, model_path, policy_kw_arg)
from .errors import EXIT_OK, CLIError


def add_parser(sub, known: str) -> None:
    """`maskahead generate`'s options (known: the registered policy names, for --help)."""
    p = sub.add_parser("generate", help="generate for one prompt")
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (encoded with the model folder's tokenizer)")
    src.add_argument("--ids", help="prompt token ids, comma-separated")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--policy", default="dense", help=f"KV-cache policy, one of: {known}; a variant label such as h2o[bits=4] "
                   "fixes knobs (as eval's --policies)")
    p.add_argument("--capacity", type=capacity_arg, default=10.0, help="KV capacity, %% of tokens seen")
    p.add_argument("--max-new-tokens", type=pos_int, default=32)
    add_mesh_arg(p)
    p.set_defaults(run=run)


def run(args) -> int:
    """Generate for one prompt; prints the text, tokens and KV statistics as JSON."""
    from ..evaluation.datasets import load_tokenizer
    from ..evaluation.policies import takes_budget
    from ..evaluation.presets import parse_variant
    from ..generate import generate

    init_mesh(args)  # before anything touches a JAX backend (multi-process runs)
    path = model_path(args.model)
    ids = None
    if args.ids is not None:
        ids = csv_list(args.ids, int)
        if not ids:
            raise CLIError("--ids is empty")
    kw = policy_kw_arg(args.policy_kw)
    try:  # a variant label, as in eval's --policies: h2o[bits=4] = --policy h2o --policy-kw bits=4
        name, variant = parse_variant(args.policy)
    except ValueError as e:
        raise CLIError(str(e)) from e
    kw.update(variant)
    cfg = model_config(path, args.family, args)
    gen = gen_config(args, args.max_new_tokens)
    cap = args.capacity if takes_budget(name) else None
    _, built = build_run_policies(cfg, gen, [name], [cap], kw, args.max_new_tokens, args.preset)
    (policy,) = built.values()
    tok = load_tokenizer(path)
    if args.chat and not tok.has_chat_template:
        raise CLIError(f"--chat: the tokenizer of {path} has no chat template (drop --chat to encode the "
                       f"prompt as it is)")
    if ids is None:
        ids = tok.encode_prompt(args.prompt, chat=args.chat)
    model, path = load_model(path, args.dtype, args.family, args)
    out = generate(model, [ids], gen, policy, mesh=args.mesh or None)
    st = out.stats
    print(json.dumps(dict(
        text=tok.decode(out.tokens[0]), tokens=out.tokens[0], policy=args.policy,
        capacity=cap, prompt_tokens=len(ids),
        nfe=st["nfe"][0], reduction_final=st["reduction_final"][0], reduction_peak=st["reduction_peak"][0],
        kv_bytes_peak=st["kv_bytes_peak"][0], wall_s=st["wall_s"]), indent=1))
    return EXIT_OK
