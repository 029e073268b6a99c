"""What the subcommands share: the model folder and its config, policies built and checked before
anything loads, and the parser's common options (model, decoding, RoPE, mesh)."""
from __future__ import annotations

import argparse
import json
import os
from typing import Optional, Sequence

from ..config import FAMILY_DEFAULTS, ConfigError
from .args import pos_float, pos_int, threshold_arg
from .errors import EXIT_USAGE, CLIError, describe_error

TESTBED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "testbed")


def model_path(path: Optional[str]) -> str:
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


def model_config(path: Optional[str], family: Optional[str] = None, args=None):
    """The ModelConfig of a model folder, read without its weights (checked before the load),
    with the command's RoPE / positions flags applied."""
    from converters.load import read_config

    path = model_path(path)
    try:
        cfg = read_config(path, family)
    except Exception as e:
        raise _cannot_load(path, e) from e
    return with_rope_flags(cfg, args)


def with_rope_flags(cfg, args):
    from ..model.rope import with_rope

    try:
        return with_rope(cfg, **_rope_knobs(args))
    except ConfigError as e:
        raise CLIError(f"--rope-theta / --rope-scaling / --max-positions: {e}") from None


def load_model(path: Optional[str], dtype: Optional[str] = None, family: Optional[str] = None, args=None):
    from ..api import load_pretrained

    path = model_path(path)
    try:
        return load_pretrained(path, dtype=dtype, family=family, **_rope_knobs(args)), path
    except Exception as e:  # a corrupt orbax folder, a bad maskahead.json, a null config field ...
        raise _cannot_load(path, e) from e


def gen_config(args, max_new: int = 64):
    from ..evaluation.presets import preset_config

    return preset_config(getattr(args, "preset", None), max_new_tokens=max_new,
                         threshold=getattr(args, "threshold", None),
                         block_size=getattr(args, "block_size", None),
                         prefill_chunk=getattr(args, "prefill_chunk", None))


def policy_kw_arg(text) -> dict:
    """'capacity_floor=128,snapkv:window=16' -> {'capacity_floor': 128, 'snapkv:window': 16}."""
    from ..evaluation.policies import parse_policy_kw

    try:
        return parse_policy_kw(text)
    except ValueError as e:
        raise CLIError(str(e)) from None


def build_run_policies(cfg, gen, policies: Sequence[str], capacities, kw: dict, max_new: Optional[int] = None,
              preset: Optional[str] = None):
    """Build and validate every (policy, capacity) against the model config before anything is
    loaded or run; returns (factory(name, capacity), {(name, capacity): policy}). PolicyError:
    unknown name, knob or knob type, a budget out of range, inconsistent settings. The preset's
    policy knobs (its scaled floors) go to the policies that have them, under --policy-kw."""
    from ..evaluation.policies import knobs, make_policy, policy_key, resolve_policy_kw
    from ..evaluation.presets import preset_policy_knobs
    from ..evaluation.sweep import build_policies

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


class Parser(argparse.ArgumentParser):
    """Usage errors as one line (`maskahead eval: error: argument --threshold: ...`), exit 2."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} -h`)\n")


def policy_names() -> str:
    """The registered policy names (plugins included when they import), for --help."""
    from .. import policies

    try:
        return ", ".join(policies.names())
    except Exception:  # a plugin that cannot be imported is reported when a policy is looked up
        from ..policies import registry

        return ", ".join(sorted(registry._REGISTRY))


def version_string() -> str:
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


def add_model_args(p, default_testbed=True):
    p.add_argument("--model", default=None,
                   help=MODEL_HELP + ("; default: the shipped testbed" if default_testbed else ""))
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--family", default=None, choices=sorted(FAMILY_DEFAULTS),
                   help="force the model family (default: from config.json; a plain autoregressive "
                        "qwen2 / qwen3 config is refused without it)")
    p.add_argument("--preset", default=None,
                   help="decoding preset: fast-dllm-v2, dream-reasoner, sdar, llada2-mini, llada, dream, testbed "
                        "(testbed also scales the policy floors: capacity_floor=64, topk_floor=32, recent=32)")
    p.add_argument("--threshold", type=threshold_arg, default=None, help="override the commit threshold, in (0, 1]")
    p.add_argument("--block-size", type=pos_int, default=None)
    p.add_argument("--prefill-chunk", type=pos_int, default=None,
                   help="prompt tokens per prefill forward, a multiple of the block size (default 512): "
                        "with bounded prefill the peak KV is the budget plus one chunk")
    p.add_argument("--policy-kw", default=None, help=POLICY_KW_HELP)
    p.add_argument("--rope-theta", type=pos_float, default=None,
                   help="replace the model's RoPE base (LongLLaDA: multiply LLaDA's / Dream's by 4-55; "
                        "docs/long_context.md)")
    p.add_argument("--rope-scaling", default=None, metavar="TYPE:FACTOR[:ORIGINAL]",
                   help="replace the model's RoPE scaling: yarn:4, linear:2, dynamic:2, llama3:8, or none; raises "
                        "the positions to FACTOR x the original length (default: the checkpoint's)")
    p.add_argument("--max-positions", type=pos_int, default=None,
                   help="override the model's max_position_embeddings (longer prompts; timing runs beyond "
                        "the trained range)")


def add_mesh_arg(parser) -> None:
    parser.add_argument("--mesh", default=None,
                        help="device mesh, e.g. data=2,model=4 or seq=4 (docs/sharding.md); multi-process: "
                             "set the MASKAHEAD_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID env vars")


def init_mesh(args) -> None:
    if getattr(args, "mesh", None):
        from ..distributed import initialize
        initialize(required=False)  # multi-process when MASKAHEAD_* env vars are set


def jax_backend() -> str:
    import jax

    return jax.default_backend()
