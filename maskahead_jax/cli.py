"""The `maskahead` command: convert, generate, eval, profile, lower, demo.

    maskahead demo
    maskahead generate --prompt "..." --policy maskahead --capacity 10
    maskahead eval --suite --policies dense,maskahead,streaming --capacity 5,10,20 --out runs/eval
    maskahead profile --shape fast-dllm-v2-7b --prompt-len 8192 --out-len 256 --batch 1,8,32
    maskahead lower --platform tpu,cuda --shape all --prompt-len 8192 --mesh none --mesh data=2,model=4
    maskahead convert SRC DST [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Optional, Sequence

from .config import FAMILY_DEFAULTS, ConfigError

TESTBED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testbed")

# One exit-status convention for every subcommand (docs/evaluation.md, `maskahead --help`).
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_STATUS = """\
exit status (every subcommand):
  0    ok
  1    a run failed (an eval run / profile case errored mid-way: the others' results are kept,
       the error is in summary.json / the JSON); also an I/O error such as a full disk
  2    bad input or usage: one line `maskahead <cmd>: error: <message>` on stderr, checked before
       any model is loaded or any forward runs (options, policies, knobs, --out, model folder, data)
  130  interrupted (Ctrl-C); an interrupted eval resumes when the same command is rerun
MASKAHEAD_TRACEBACK=1 shows the full traceback instead of the one-line error."""


class CLIError(Exception):
    pass


# ----------------------------------------------------------------------------- argument types
def _int_at_least(lo: int):
    def parse(text):
        try:
            v = int(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be {'positive' if lo == 1 else f'>= {lo}'}, got {v}")
        return v
    return parse


def _float_in(lo: float, hi: Optional[float], what: str):
    """A float in (lo, hi] (hi None: > lo)."""
    def parse(text):
        try:
            v = float(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (lo < v and (hi is None or v <= hi)):  # NaN fails too
            raise argparse.ArgumentTypeError(f"{what}, got {text}")
        return v
    return parse


_pos_int = _int_at_least(1)
_threshold = _float_in(0.0, 1.0, "a commit threshold in (0, 1]")
_capacity = _float_in(0.0, 100.0, "a percentage in (0, 100]")
_pos_float = _float_in(0.0, None, "must be positive")


def _csv(text, typ=str) -> list:
    try:
        return [typ(x) for x in str(text).split(",") if x.strip() != ""]
    except ValueError:
        raise CLIError(f"cannot parse {text!r} as a comma-separated list of {typ.__name__}") from None


def _pos_ints(text, flag: str) -> list:
    vals = _csv(text, int)
    if not vals or any(v <= 0 for v in vals):
        raise CLIError(f"{flag} {text}: expected positive integers, comma-separated")
    return vals


def _depths(text) -> list:
    vals = _csv(text, float)
    bad = [d for d in vals if not 0.0 <= d <= 1.0]
    if not vals or bad:
        raise CLIError(f"--depths {text}: depths are fractions of the context in [0, 1]"
                       + (f" ({', '.join(f'{d:g}' for d in bad)} is not)" if bad else ""))
    return vals


# ----------------------------------------------------------------------------- output paths
def _nearest_existing(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.lexists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def _writable_folder(folder: str, what: str) -> None:
    """CLIError unless `folder` (which exists) is a folder we can create files in."""
    if not os.path.isdir(folder):
        raise CLIError(f"{what}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise CLIError(f"{what}: {folder} is not writable")
    try:  # read-only file systems, and root (whom os.access always lets through)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".maskahead-write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CLIError(f"{what}: cannot write in {folder} ({e.strerror or e})") from None


def _can_create_in(folder: str, what: str) -> None:
    """CLIError unless files can be created in `folder`: a writable folder, or a path whose
    nearest existing parent is one (the folder is created later). Nothing is created here."""
    if os.path.exists(folder):
        if not os.path.isdir(folder):
            raise CLIError(f"{what}: {folder} is a file, not a folder")
        _writable_folder(folder, what)
    else:
        anc = _nearest_existing(folder)
        if not os.path.isdir(anc):
            raise CLIError(f"{what} cannot be created: {anc} is a file, not a folder")
        _writable_folder(anc, f"{what} cannot be created")


def check_out_dir(path: str, flag: str = "--out") -> None:
    """An output folder: an existing writable folder, or a path where one can be created."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise CLIError(f"{flag} {path} is a file; expected a folder")
    _can_create_in(path, f"{flag} {path}")


def check_out_file(path: str, flag: str = "--out") -> None:
    """An output file: not a folder, in a folder that is writable or can be created."""
    if path.endswith(("/", os.sep)) or os.path.isdir(path):
        raise CLIError(f"{flag} {path} is a folder; expected a file path, e.g. "
                       f"{os.path.join(path, 'profile.json')}")
    _can_create_in(os.path.dirname(os.path.abspath(path)), f"{flag} {path}")


# ----------------------------------------------------------------------------- errors
def _one_line(text: str, limit: int = 500) -> str:
    lines = [x.strip() for x in str(text).splitlines() if x.strip()]
    first = lines[0] if lines else ""
    if len(first) > limit:
        first = first[:limit] + " ..."
    return first


_PLAIN = (ValueError, OSError, FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError)


def describe_error(e: BaseException) -> str:
    """One line for an error: this project's own errors by their message (written to be read);
    a foreign one (orbax, tensorstore, json, ...) by its root cause; the type is named unless it
    is one whose message reads on its own (ValueError, OSError and the like)."""
    if isinstance(e, CLIError) or type(e).__module__.split(".")[0] in ("maskahead_jax", "converters"):
        return _one_line(str(e)) or type(e).__name__
    seen = {id(e)}
    while True:
        nxt = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
        if nxt is None or id(nxt) in seen:
            break
        seen.add(id(nxt))
        e = nxt
    text = _one_line(str(e))
    if text and type(e) in _PLAIN:
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# ----------------------------------------------------------------------------- model, policies
def _model_path(path: Optional[str]) -> str:
    """The local model folder of --model: the testbed by default; a path that exists as given;
    else a Hugging Face hub id ("org/name") resolved through the Hugging Face cache (downloaded
    when the hub is reachable, offline from the cache; converters.load.resolve_model_path)."""
    path = path or TESTBED
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise CLIError(f"--model {path} is a file; expected a model folder or a hub id (org/name)")
    from converters.load import is_hub_id, resolve_model_path

    if not is_hub_id(path):
        raise CLIError(f"model folder not found: {path} (a Hugging Face hub id has the form org/name)")
    return resolve_model_path(path)  # HubError: one line saying how to get the model


def _null_fields(path: str) -> str:
    """' (config.json has null hidden_size, ...)' when the folder's config.json has null fields."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            hf = json.load(f)
        nulls = [k for k, v in hf.items() if v is None] if isinstance(hf, dict) else []
    except (OSError, ValueError):
        return ""
    return f" (config.json has null {', '.join(nulls)})" if nulls else ""


def _cannot_load(path: str, e: Exception) -> CLIError:
    return CLIError(f"cannot load {path}: {describe_error(e)}{_null_fields(path)}")


def _rope_knobs(args) -> dict:
    """load_pretrained's RoPE knobs from --rope-theta / --rope-scaling / --max-positions."""
    return dict(rope_theta=getattr(args, "rope_theta", None), rope_scaling=getattr(args, "rope_scaling", None),
                max_position_embeddings=getattr(args, "max_positions", None))


def _model_config(path: Optional[str], family: Optional[str] = None, args=None):
    """The ModelConfig of a model folder, read without its weights (checked before the load),
    with the command's RoPE / positions flags applied."""
    from converters.load import read_config

    path = _model_path(path)
    try:
        cfg = read_config(path, family)
    except Exception as e:
        raise _cannot_load(path, e) from e
    return _with_rope_flags(cfg, args)


def _with_rope_flags(cfg, args):
    from .model.rope import with_rope

    try:
        return with_rope(cfg, **_rope_knobs(args))
    except ConfigError as e:
        raise CLIError(f"--rope-theta / --rope-scaling / --max-positions: {e}") from None


def _load(path: Optional[str], dtype: Optional[str] = None, family: Optional[str] = None, args=None):
    from .api import load_pretrained

    path = _model_path(path)
    try:
        return load_pretrained(path, dtype=dtype, family=family, **_rope_knobs(args)), path
    except Exception as e:  # a corrupt orbax folder, a bad maskahead.json, a null config field ...
        raise _cannot_load(path, e) from e


def _gen(args, max_new: int = 64):
    from .evaluation.presets import preset_config

    return preset_config(getattr(args, "preset", None), max_new_tokens=max_new,
                         threshold=getattr(args, "threshold", None),
                         block_size=getattr(args, "block_size", None),
                         prefill_chunk=getattr(args, "prefill_chunk", None))


def _kw(text) -> dict:
    """'capacity_floor=128,snapkv:window=16' -> {'capacity_floor': 128, 'snapkv:window': 16}."""
    from .evaluation.policies import parse_policy_kw

    try:
        return parse_policy_kw(text)
    except ValueError as e:
        raise CLIError(str(e)) from None


def _policies(cfg, gen, policies: Sequence[str], capacities, kw: dict, max_new: Optional[int] = None,
              preset: Optional[str] = None):
    """Build and validate every (policy, capacity) against the model config before anything is
    loaded or run; returns (factory(name, capacity), {(name, capacity): policy}). PolicyError:
    unknown name, knob or knob type, a budget out of range, inconsistent settings. The preset's
    policy knobs (its scaled floors) go to the policies that have them, under --policy-kw."""
    from .evaluation.policies import knobs, make_policy, policy_key, resolve_policy_kw
    from .evaluation.presets import preset_policy_knobs
    from .evaluation.sweep import build_policies

    if not policies:
        raise CLIError("no policies given")
    per = resolve_policy_kw(policies, kw)
    for name, given in per.items():
        for k, v in preset_policy_knobs(preset).items():
            if k in knobs(name) and k not in given:
                given[k] = v

    def factory(name, cap):
        return make_policy(name, cap, **per[policy_key(name)])

    return factory, build_policies(cfg, gen, policies, capacities, factory, max_new)


# ----------------------------------------------------------------------------- parser
POLICY_KW_HELP = ("policy knobs: key=value applies to every policy of the run that has the knob (an error if "
                  "none has it); name:key=value to that policy only, e.g. "
                  "maskahead:capacity_floor=128,snapkv:window=16,topk_floor=32")


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (`maskahead eval: error: argument --threshold: ...`), exit 2."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} -h`)\n")


def _policy_names() -> str:
    """The registered policy names (plugins included when they import), for --help."""
    from . import policies

    try:
        return ", ".join(policies.names())
    except Exception:  # a plugin that cannot be imported is reported when a policy is looked up
        from .policies import registry

        return ", ".join(sorted(registry._REGISTRY))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    def v(dist):
        try:
            return version(dist)
        except PackageNotFoundError:
            return "unknown (not installed)"

    return f"maskahead-jax {v('maskahead-jax')} (jax {v('jax')})"


MODEL_HELP = ("model folder (HF layout or `maskahead convert`ed), or a Hugging Face hub id such as "
              "Efficient-Large-Model/Fast_dLLM_v2_7B (through the HF cache: downloaded when the hub is "
              "reachable, from the cache offline / with HF_HUB_OFFLINE=1; HF_HOME, HF_HUB_CACHE respected; "
              "a local path that exists wins)")


def _add_model(p, default_testbed=True):
    p.add_argument("--model", default=None,
                   help=MODEL_HELP + ("; default: the shipped testbed" if default_testbed else ""))
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--family", default=None, choices=sorted(FAMILY_DEFAULTS),
                   help="force the model family (default: from config.json; a plain autoregressive "
                        "qwen2 / qwen3 config is refused without it)")
    p.add_argument("--preset", default=None,
                   help="decoding preset: fast-dllm-v2, dream-reasoner, sdar, llada2-mini, llada, dream, testbed "
                        "(testbed also scales the policy floors: capacity_floor=64, topk_floor=32, recent=32)")
    p.add_argument("--threshold", type=_threshold, default=None, help="override the commit threshold, in (0, 1]")
    p.add_argument("--block-size", type=_pos_int, default=None)
    p.add_argument("--prefill-chunk", type=_pos_int, default=None,
                   help="prompt tokens per prefill forward, a multiple of the block size (default 512): "
                        "with bounded prefill the peak KV is the budget plus one chunk")
    p.add_argument("--policy-kw", default=None, help=POLICY_KW_HELP)
    p.add_argument("--rope-theta", type=_pos_float, default=None,
                   help="replace the model's RoPE base (LongLLaDA: multiply LLaDA's / Dream's by 4-55; "
                        "docs/long_context.md)")
    p.add_argument("--rope-scaling", default=None, metavar="TYPE:FACTOR[:ORIGINAL]",
                   help="replace the model's RoPE scaling: yarn:4, linear:2, dynamic:2, llama3:8, or none; raises "
                        "the positions to FACTOR x the original length (default: the checkpoint's)")
    p.add_argument("--max-positions", type=_pos_int, default=None,
                   help="override the model's max_position_embeddings (longer prompts; timing runs beyond "
                        "the trained range)")


def _add_mesh(parser) -> None:
    parser.add_argument("--mesh", default=None,
                        help="device mesh, e.g. data=2,model=4 or seq=4 (docs/sharding.md); multi-process: "
                             "set the MASKAHEAD_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID env vars")


def _init_mesh(args) -> None:
    if getattr(args, "mesh", None):
        from .distributed import initialize
        initialize(required=False)  # multi-process when MASKAHEAD_* env vars are set


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="maskahead", description=__doc__, epilog=EXIT_STATUS,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=_version())
    known = _policy_names()
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("convert", add_help=False, help="HF checkpoint -> orbax folder (see `maskahead convert -h`)")

    g = sub.add_parser("generate", help="generate for one prompt")
    _add_model(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (encoded with the model folder's tokenizer)")
    src.add_argument("--ids", help="prompt token ids, comma-separated")
    g.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    g.add_argument("--policy", default="dense", help=f"KV-cache policy, one of: {known}")
    g.add_argument("--capacity", type=_capacity, default=10.0, help="KV capacity, %% of tokens seen")
    g.add_argument("--max-new-tokens", type=_pos_int, default=32)
    _add_mesh(g)

    e = sub.add_parser("eval", help="policies x budgets sweep")
    _add_model(e)
    e.add_argument("--policies", default=None, help=f"comma-separated, from: {known} (default dense,maskahead)")
    e.add_argument("--capacity", default=None, help="comma-separated %% budgets, e.g. 5,10,20 (default 10)")
    e.add_argument("--out", required=True, help="output folder (results.jsonl, summary.md/json, *.png)")
    e.add_argument("--batch-size", type=_pos_int, default=None, help="default 8 (a --sweep: its own)")
    e.add_argument("--sweep", default=None,
                   help="a whole named sweep instead of --suite/--policies/--capacity/--preset: "
                        "testbed-policies = docs/results.md §2 (the five testbed tasks at 2048 tokens x 2 "
                        "seeds x 5 depths, passkey at 4096 x 1 x 5; dense, maskahead, maskahead-bounded, "
                        "streaming, h2o, caote, snapkv, ea, dapq, mage, herald, pyramidkv, adakv (block_causal=true: the testbed is block-causal), "
                        "q-maskahead[bits=4], q-maskahead[bits=2], q-maskahead[bits=4,compaction=lazy] at 10%%, then 5%%, then 20%%; --preset "
                        "testbed and its floors; batch 4). Resumes like any eval: rerun the same command")
    e.add_argument("--bucket", default="auto",
                   help="prompt-length bucket quantum in tokens, or auto (<= 12.5%% padding)")
    e.add_argument("--max-new-tokens", type=_pos_int, default=None, help="override the per-dataset lengths")
    e.add_argument("--suite", action="store_true", help="the testbed task suite")
    e.add_argument("--tasks", default="passkey,multikey,twohop,docqa,longanswer")
    e.add_argument("--lengths", default="512,1024", help="suite / needle context lengths (tokens)")
    e.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths, fractions in [0, 1]")
    e.add_argument("--n", type=_pos_int, default=2, help="examples per (task, length, depth) cell")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--needle", action="store_true", help="needle grid (length x depth)")
    e.add_argument("--needle-task", default="passkey", choices=["passkey", "twohop"])
    e.add_argument("--longbench", default=None,
                   help="LongBench v1 JSONL files or folders, LongBench v2 data.json, comma-separated")
    e.add_argument("--longbench-datasets", default=None, help="keep only these datasets (v2: longbench_v2)")
    e.add_argument("--max-length", type=_pos_int, default=None,
                   help="LongBench middle-truncation length (default: model positions - max new - 2 blocks)")
    e.add_argument("--no-chat", action="store_true", help="never apply the chat template")
    e.add_argument("--math", action="append", default=[], help="GSM8K / MATH-500 JSONL (repeatable)")
    e.add_argument("--math-max-new-tokens", type=_pos_int, default=2048)
    e.add_argument("--limit", type=_pos_int, default=None, help="examples per LongBench / math file")
    e.add_argument("--ruler", default=None, metavar="LENGTHS",
                   help="RULER at these total lengths in model tokens (prompt + generation), comma-separated, "
                        "e.g. 4096,8192; generated offline (needs the [ruler] extra)")
    e.add_argument("--ruler-tasks", default=None,
                   help="RULER tasks, comma-separated, or all (default: every task the given data allows: "
                        "niah_single_1, niah_multikey_2, niah_multikey_3, vt, cwe, fwe always; the essay tasks "
                        "with --ruler-haystack; qa_1 / qa_2 with --ruler-qa)")
    e.add_argument("--ruler-haystack", default=None, metavar="TEXT_FILE",
                   help="plain text for RULER's essay haystack (RULER uses Paul Graham's essays; not shipped)")
    e.add_argument("--ruler-qa", default=None, metavar="FILE[,FILE]",
                   help="SQuAD v2 dev JSON (qa_1) and/or HotpotQA dev distractor JSON (qa_2)")
    e.add_argument("--ruler-n", type=_pos_int, default=25, help="RULER examples per (task, length)")
    e.add_argument("--strict", action="store_true", help="stop at the first failing policy")
    _add_mesh(e)
    e.add_argument("--no-plots", action="store_true")
    e.add_argument("--no-progress", action="store_true")

    p = sub.add_parser("profile", help="systems profile (prefill / decode / e2e, peak KV, serving capacity)")
    _add_model(p)
    p.add_argument("--shape", default=None, help="random-weight real-model shape: fast-dllm-v2-7b, sdar-8b, llada-8b, llada2-mini")
    p.add_argument("--layers", type=_pos_int, default=None, help="with --shape: use fewer layers (smoke runs)")
    p.add_argument("--prompt-len", type=_pos_int, default=1024)
    p.add_argument("--out-len", type=_pos_int, default=256)
    p.add_argument("--batch", default="1", help="batch sizes, comma-separated")
    p.add_argument("--policies", default="dense,maskahead,q-maskahead", help=f"comma-separated, from: {known}")
    p.add_argument("--capacity", type=_capacity, default=10.0)
    p.add_argument("--repeats", type=_pos_int, default=1)
    p.add_argument("--kv-budget-gb", type=_pos_float, default=40.0, help="KV memory budget for serving capacity")
    _add_mesh(p)
    p.add_argument("--out", default=None, help="write the full result as JSON to this file (atomically); "
                                                "stdout gets a table")
    p.add_argument("--json", action="store_true", help="print the JSON on stdout instead of the table")

    lo = sub.add_parser("lower", help="lower the generate programs for TPU / CUDA without a device (and --plan: "
                                      "the per-device memory plan)")
    _add_lower_args(lo)

    d = sub.add_parser("demo", help="testbed needle prompts: dense vs MaskAhead side by side")
    d.add_argument("--tasks", default="passkey,multikey",
                   help="testbed tasks to draw the prompts from (one per depth each), comma-separated")
    d.add_argument("--length", type=_pos_int, default=2048,
                   help="prompt length in tokens (default 2048: long enough that the testbed floors stay below "
                        "the 10%% budget)")
    d.add_argument("--depths", default="0.25,0.75", help="needle depths, fractions in [0, 1]")
    d.add_argument("--capacity", type=_capacity, default=10.0)
    d.add_argument("--policy", default="maskahead",
                   help=f"the policies to compare with dense, comma-separated, from: {known}")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--policy-kw", default=None,
                   help=POLICY_KW_HELP + f". Default: {DEMO_KW} where a policy has the knob (the testbed "
                        "preset's floors, as `maskahead eval --preset testbed`: the paper's 512 / 256 exceed 10%% of "
                        "the testbed's prompts; and an eviction at every block, so the end shows the budget)")
    return ap


DEMO_KW = "capacity_floor=64,topk_floor=32,recent=32,interval_blocks=1"  # evaluation.presets' testbed floors


# ----------------------------------------------------------------------------- commands
def jax_backend() -> str:
    import jax

    return jax.default_backend()


def cmd_generate(args) -> int:
    from .evaluation.datasets import load_tokenizer
    from .evaluation.policies import takes_budget
    from .generate import generate

    _init_mesh(args)  # before anything touches a JAX backend (multi-process runs)
    path = _model_path(args.model)
    ids = None
    if args.ids is not None:
        ids = _csv(args.ids, int)
        if not ids:
            raise CLIError("--ids is empty")
    kw = _kw(args.policy_kw)
    cfg = _model_config(path, args.family, args)
    gen = _gen(args, args.max_new_tokens)
    cap = args.capacity if takes_budget(args.policy) else None
    _, built = _policies(cfg, gen, [args.policy], [cap], kw, args.max_new_tokens, args.preset)
    (policy,) = built.values()
    tok = load_tokenizer(path)
    if args.chat and not tok.has_chat_template:
        raise CLIError(f"--chat: the tokenizer of {path} has no chat template (drop --chat to encode the "
                       f"prompt as it is)")
    if ids is None:
        ids = tok.encode_prompt(args.prompt, chat=args.chat)
    model, path = _load(path, args.dtype, args.family, args)
    out = generate(model, [ids], gen, policy, mesh=args.mesh or None)
    st = out.stats
    print(json.dumps(dict(
        text=tok.decode(out.tokens[0]), tokens=out.tokens[0], policy=args.policy,
        capacity=cap, prompt_tokens=len(ids),
        nfe=st["nfe"][0], reduction_final=st["reduction_final"][0], reduction_peak=st["reduction_peak"][0],
        kv_bytes_peak=st["kv_bytes_peak"][0], wall_s=st["wall_s"]), indent=1))
    return EXIT_OK


def _rows_saved(out_dir: str) -> int:
    from .evaluation.sweep import load_rows

    try:
        return len(load_rows(os.path.join(out_dir, "results.jsonl"), repair=False))
    except (OSError, ValueError):
        return 0


def _interrupted_message(args) -> str:
    """The line Ctrl-C prints (interrupt.py): an eval says how many rows are saved."""
    out = getattr(args, "out", None)
    if args.cmd == "eval" and out and os.path.exists(os.path.join(out, "results.jsonl")):
        return (f"maskahead eval: interrupted; {_rows_saved(out)} rows saved in "
                f"{os.path.join(out, 'results.jsonl')}, rerun the same command to resume")
    return f"maskahead {args.cmd}: interrupted"


def cmd_eval(args) -> int:
    from .evaluation import datasets as D
    from .evaluation.policies import parse_capacities
    from .evaluation.sweep import run_sweep

    # everything that can be refused is checked before the model's weights are loaded
    check_out_dir(args.out)
    _init_mesh(args)  # before anything touches a JAX backend (multi-process runs)
    if args.sweep:
        return _cmd_eval_sweep(args)
    if not (args.suite or args.needle or args.longbench or args.math or args.ruler):
        raise CLIError("no examples: pass --suite, --needle, --longbench PATHS, --math FILE and/or --ruler LENGTHS")
    args.policies = args.policies or "dense,maskahead"
    args.capacity = args.capacity or "10"
    args.batch_size = args.batch_size or 8
    lengths = _pos_ints(args.lengths, "--lengths") if args.suite or args.needle else []
    depths = _depths(args.depths) if args.suite or args.needle else []
    bucket = args.bucket if args.bucket == "auto" else _pos_ints(args.bucket, "--bucket")[0]
    policies = _csv(args.policies)
    caps = parse_capacities(args.capacity)
    kw = _kw(args.policy_kw)
    path = _model_path(args.model)
    cfg = _model_config(path, args.family, args)
    gen = _gen(args)
    factory, _ = _policies(cfg, gen, policies, caps, kw, args.max_new_tokens, args.preset)

    ruler = _ruler_setup(args, cfg) if args.ruler else None  # refused before the tokenizer loads
    tok = D.load_tokenizer(path)
    exs = []
    # the dataset options of the run fingerprint (with the model and generation settings: run.json)
    dataset = {}
    if args.suite:
        exs += D.testbed_suite(_csv(args.tasks), lengths, depths, n_per_cell=args.n, seed=args.seed, tokenizer=tok)
        dataset["suite"] = dict(tasks=_csv(args.tasks), lengths=lengths, depths=depths, n=args.n, seed=args.seed)
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
    if ruler:
        from .evaluation.ruler import ruler_examples

        exs += ruler_examples(ruler["tasks"], ruler["lengths"], tok, args.ruler_n, ruler.pop("sources"),
                              seed=args.seed, chat=not args.no_chat)
        dataset["ruler"] = ruler
    if not exs:
        raise CLIError("no examples: the data files given hold none (or --longbench-datasets kept none)")
    _check_positions(exs, cfg, gen, args.max_new_tokens)

    model, path = _load(path, args.dtype, args.family, args)
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
        results = os.path.join(args.out, "results.jsonl")
        print(f"\nmaskahead eval: interrupted; {_rows_saved(args.out)} rows saved in {results}, rerun the "
              f"same command to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    return _report_eval(res)


def _check_positions(exs, cfg, gen, max_new: Optional[int]) -> None:
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


def _ruler_setup(args, cfg) -> dict:
    """RULER's options checked up front (lengths within the model's positions, tasks, local files,
    wonderwords), the local files read; returns the run-fingerprint entry with the sources."""
    from .evaluation import ruler as R

    lengths = _pos_ints(args.ruler, "--ruler")
    too_long = [n for n in lengths if n > cfg.max_position_embeddings]
    if too_long:
        raise CLIError(f"--ruler {','.join(map(str, too_long))}: beyond the model's "
                       f"{cfg.max_position_embeddings} positions")
    qa_paths = _csv(args.ruler_qa) if args.ruler_qa else []
    sources = R.load_sources(args.ruler_haystack, qa_paths)
    if args.ruler_tasks in (None, ""):
        tasks = R.available_tasks(sources)
        skipped = [t for t in R.TASK_NAMES if t not in tasks]
        if skipped:
            print(f"[eval] RULER: skipping {', '.join(skipped)} (no --ruler-haystack / --ruler-qa data for them)",
                  file=sys.stderr)
    else:
        tasks = list(R.TASK_NAMES) if args.ruler_tasks == "all" else _csv(args.ruler_tasks)
    R.check_tasks(tasks, sources)
    files = ([args.ruler_haystack] if args.ruler_haystack else []) + qa_paths
    return dict(tasks=tasks, lengths=lengths, n=args.ruler_n, seed=args.seed, no_chat=args.no_chat,
                generator=R.GENERATOR_VERSION,
                files=[dict(path=os.path.abspath(f), sha256=R.file_digest(f)) for f in files], sources=sources)


def _cmd_eval_sweep(args) -> int:
    """`maskahead eval --sweep NAME`: a named sweep preset (evaluation.presets.SWEEPS) sets the
    examples, policies, budgets, decoding preset and its policy knobs; only the model, --out,
    --batch-size and the progress / plot switches may be given with it."""
    from .evaluation import datasets as D
    from .evaluation.presets import sweep_examples, sweep_factory, sweep_preset
    from .evaluation.sweep import build_policies, run_sweep

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
    path = _model_path(args.model)
    cfg = _model_config(path, args.family, args)
    gen = _gen(args)
    factory = sweep_factory(sp)
    build_policies(cfg, gen, sp.policies, sp.capacities, factory)  # refuse before loading anything
    tok = D.load_tokenizer(path)
    exs = sweep_examples(sp, tok)
    dataset = dict(sweep=dict(name=args.sweep, cells=[[list(t), ln, n, sfx] for t, ln, n, sfx in sp.cells],
                              depths=list(sp.depths), seed=sp.seed))
    model, path = _load(path, args.dtype, args.family, args)
    print(f"[eval] sweep {args.sweep}: {len(exs)} examples x {len(sp.policies)} policies x "
          f"{len(sp.capacities)} capacities -> {args.out}", file=sys.stderr)
    try:
        res = run_sweep(model, exs, sp.policies, sp.capacities, args.out, tok, gen=gen,
                        batch_size=args.batch_size or sp.batch_size, progress=not args.no_progress,
                        strict=args.strict, plots=not args.no_plots, policy_factory=factory,
                        bucket="auto" if args.bucket == "auto" else _pos_ints(args.bucket, "--bucket")[0],
                        meta=dict(model=path, sweep=args.sweep, argv=sys.argv[1:]), mesh=args.mesh,
                        model_path=os.path.realpath(path), dataset=dataset, score_datasets=sp.score_datasets,
                        order=sp.order)
    except KeyboardInterrupt:
        print(f"\nmaskahead eval: interrupted; {_rows_saved(args.out)} rows saved in "
              f"{os.path.join(args.out, 'results.jsonl')}, rerun the same command to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    return _report_eval(res)


def _report_eval(res) -> int:
    with open(res.paths["summary_md"], encoding="utf-8") as f:
        print(f.read())
    print(json.dumps({k: v for k, v in res.paths.items()}, indent=1))
    if res.errors:
        from .evaluation.sweep import cap_label

        for err in res.errors:
            print(f"maskahead eval: run {err['policy']}@{cap_label(err['capacity'])} failed: "
                  f"{_one_line(err['error'])}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def cmd_profile(args) -> int:
    from . import profile as PR

    if args.out:
        check_out_file(args.out)
    _init_mesh(args)  # before anything touches a JAX backend (multi-process runs)
    batches = _pos_ints(args.batch, "--batch")
    policies = _csv(args.policies)
    kw = _kw(args.policy_kw)
    if args.shape:
        cfg = PR.shape_config(args.shape, args.layers)
        cfg = _with_rope_flags(cfg, args)
        label = args.shape + (f" ({args.layers} layers)" if args.layers else "")
        if args.preset is None:
            args.preset = PR.SHAPE_PRESET.get(args.shape.lower())
    else:
        label = _model_path(args.model)
        cfg = _model_config(label, args.family, args)
    gen = _gen(args)
    bs = gen.block_size or cfg.block_size
    if args.out_len <= bs:
        raise CLIError(f"--out-len {args.out_len} must exceed one block ({bs}) to split prefill and decode")
    if not policies:
        raise CLIError("no policies given")
    PR.build_policies(cfg, gen, policies, args.capacity, args.out_len, kw)  # refuse before the load

    if args.shape:
        model = PR.random_model(cfg, dtype=args.dtype or "bfloat16")
    else:
        from .api import Model

        model, _ = _load(label, args.dtype, args.family, args)
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
        from .evaluation.atomic import write_text

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
                  f"{_one_line(sk['reason'])}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _add_lower_args(p) -> None:
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
    p.add_argument("--out-len", type=_pos_int, default=256, help="new tokens per prompt")
    p.add_argument("--capacity", type=_capacity, default=10.0, help="budget of the evicting policies, %%")
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


def cmd_lower(args) -> int:
    from . import lowering as LW

    shapes = LW.shape_names(args.shape)
    lens = _pos_ints(args.prompt_len, "--prompt-len")
    batches = _pos_ints(args.batch, "--batch") if args.batch else None
    pols = None if args.policies.strip() == "default" else [x.strip() for x in _split_items(args.policies) if x.strip()]
    if args.plan:
        if len(shapes) != 1:
            raise CLIError("--plan takes one --shape")
        plan = LW.memory_plan(shapes[0], lens, batches or (1, 8, 32), pols, args.out_len, args.capacity,
                              compile_temps=not args.no_compile, cache_file=args.compile_cache, log=sys.stderr)
        print(json.dumps(plan, indent=1) if args.json else LW.plan_table(plan))
        return EXIT_FAILED if any("xla_error" in r for r in plan["rows"]) else EXIT_OK
    plats = _csv(args.platform)
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


def _split_items(text: str) -> list:
    from .evaluation.policies import split_items

    return split_items(text)


def cmd_demo(args) -> int:
    from .evaluation.datasets import load_tokenizer, score_example, testbed_suite
    from .evaluation.policies import (knobs, make_policy, parse_policy_kw, policy_key, resolve_policy_kw,
                                      run_label, takes_budget, validate_policy)
    from .generate import generate

    t_start = time.perf_counter()
    depths = _depths(args.depths)
    names = [n for n in dict.fromkeys(policy_key(x) for x in _csv(args.policy)) if n != "dense"]
    if args.policy_kw is None:  # the demo's floors, where a policy has them
        per = {n: {k: v for k, v in parse_policy_kw(DEMO_KW).items() if k in knobs(n)} for n in names}
    else:
        per = resolve_policy_kw(names, _kw(args.policy_kw))
    path = _model_path(None)
    cfg = _model_config(path)
    tok = load_tokenizer(path)
    exs = testbed_suite(_csv(args.tasks), [args.length], depths, n_per_cell=1, seed=args.seed, tokenizer=tok)
    gen = _gen(argparse.Namespace(preset=None), max_new=max(e.max_new_tokens for e in exs))
    resolved = gen.resolve(cfg)
    runs = [("dense", make_policy("dense"))]
    for name in names:
        cap = args.capacity if takes_budget(name) else None
        pol = make_policy(name, cap, **per[name])
        validate_policy(pol, cfg, resolved, run_label(name, cap))
        runs.append((name, pol))
    model, path = _load(path)
    print(f"MaskAhead demo: testbed model ({path}), tasks {args.tasks}, {args.length}-token prompts, "
          f"depths {args.depths}, capacity {args.capacity:g}%")
    if len(runs) == 1:
        print("note: showing the dense cache only.")
    results = {}
    ids = [e.ids for e in exs]
    where = ("up to a minute on a few CPU cores" if jax_backend() == "cpu" else "seconds on an accelerator")
    for name, pol in runs:
        # the first call compiles (jit, once per policy and shape) and prints nothing for a while
        print(f"[demo] compiling {name} for {len(ids)} prompt{'' if len(ids) == 1 else 's'} of {args.length} "
              f"tokens (first call; {where})...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        for timed in (False, True):  # one call site: a policy's BudgetWarning is shown once
            out = generate(model, ids, gen, pol)
            if not timed:
                print(f"[demo] {name}: compiled and ran in {time.perf_counter() - t0:.1f}s", file=sys.stderr,
                      flush=True)
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
    print("\n KV reduction: a bf16 cache of every token seen / the bytes the policy holds (its eviction "
          "state included),\n the least over the prompts; end: after the answer, peak: the most held at "
          "any time. MaskAhead\n evicts once the whole prompt is in, so its peak is the prompt "
          "(maskahead-bounded bounds the prefill too).")
    print(f"\n total {time.perf_counter() - t_start:.1f}s")
    return EXIT_OK


# ----------------------------------------------------------------------------- convert
class _QuietParser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)


def _convert_precheck(argv: Sequence[str]) -> Optional[str]:
    """The destination of `maskahead convert SRC DST` checked before the checkpoint is read: a
    folder (or a path where one can be created) whose parent is writable (convert writes a
    sibling temporary folder there). Returns the error, or None (also when argv does not parse:
    converters.load.cli_convert reports that)."""
    ap = _QuietParser(add_help=False)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--dtype")
    ap.add_argument("--family")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("-h", "--help", action="store_true")
    try:
        a, _ = ap.parse_known_args(list(argv))
    except ValueError:
        return None
    if a.help:
        return None
    try:
        if os.path.lexists(a.dst) and not os.path.isdir(a.dst):
            raise CLIError(f"destination {a.dst} is a file, not a folder")
        _can_create_in(os.path.dirname(os.path.abspath(a.dst)), f"destination {a.dst}")
    except CLIError as e:
        return str(e)
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The `maskahead` command; returns the exit status (EXIT_STATUS)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = bool(os.environ.get("MASKAHEAD_TRACEBACK"))
    if argv and argv[0] == "convert":
        err = _convert_precheck(argv[1:])
        if err:
            print(f"maskahead convert: error: {err}", file=sys.stderr)
            return EXIT_USAGE
        from converters.load import cli_convert

        try:
            return cli_convert(argv[1:])
        except KeyboardInterrupt:
            if debug:
                raise
            print("\nmaskahead convert: interrupted (the destination is left as it was)", file=sys.stderr)
            return EXIT_INTERRUPTED
    args = build_parser().parse_args(argv)  # usage errors: argparse's one line, exit 2

    fn = dict(generate=cmd_generate, eval=cmd_eval, profile=cmd_profile, lower=cmd_lower, demo=cmd_demo)[args.cmd]
    try:
        if debug:  # Ctrl-C raises KeyboardInterrupt, for its traceback
            return fn(args)
        from . import interrupt

        # Ctrl-C: exit 130 at once once the files are flushed, never unwinding through XLA
        with interrupt.handle_sigint(lambda: _interrupted_message(args)):
            return fn(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"\nmaskahead {args.cmd}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        from .evaluation.sweep import RunFailed

        if debug:
            raise
        if isinstance(e, RunFailed):  # --strict: the first failing run stops the sweep
            print(f"maskahead {args.cmd}: error: run {describe_error(e)}", file=sys.stderr)
            return EXIT_FAILED
        if isinstance(e, (CLIError, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
                          PermissionError)):  # PolicyError, ConfigError, CheckpointError, RunMismatch ...
            print(f"maskahead {args.cmd}: error: {describe_error(e)}", file=sys.stderr)
            return EXIT_USAGE
        if isinstance(e, OSError):  # e.g. a full disk while writing results
            print(f"maskahead {args.cmd}: error: {describe_error(e)}", file=sys.stderr)
            return EXIT_FAILED
        raise


if __name__ == "__main__":
    sys.exit(main())
