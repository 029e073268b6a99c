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
import os
import sys
from typing import Optional, Sequence

from . import convert, demo, evaluate, generate, lower, profile
from .args import check_out_dir, check_out_file
from .common import (TESTBED, Parser, build_run_policies, jax_backend, load_model, model_config, model_path,
                     policy_names, version_string)
from .errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_STATUS, EXIT_USAGE, CLIError, describe_error
from .evaluate import interrupted_line

# one module per subcommand, each with add_parser(sub, known) and run(args)
COMMANDS = (generate, evaluate, profile, lower, demo)

__all__ = ["main", "build_parser", "CLIError", "describe_error", "check_out_dir", "check_out_file", "TESTBED",
           "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_INTERRUPTED", "COMMANDS", "jax_backend",
           "load_model", "model_config", "model_path", "build_run_policies"]


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="maskahead", description=__doc__, epilog=EXIT_STATUS,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=version_string())
    known = policy_names()
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("convert", add_help=False, help="HF checkpoint -> orbax folder (see `maskahead convert -h`)")
    for command in COMMANDS:
        command.add_parser(sub, known)
    return ap


def interrupted_message(args) -> str:
    """The line Ctrl-C prints (interrupt.py): an eval says how many rows are saved."""
    out = getattr(args, "out", None)
    if args.cmd == "eval" and out and os.path.exists(os.path.join(out, "results.jsonl")):
        return interrupted_line(out)
    return f"maskahead {args.cmd}: interrupted"


def _exit_status(cmd: str, e: Exception) -> int:
    """The one line and exit status of an error a subcommand raised (EXIT_STATUS); re-raises a bug."""
    from ..evaluation.sweep import RunFailed

    if isinstance(e, RunFailed):  # --strict: the first failing run stops the sweep
        print(f"maskahead {cmd}: error: run {describe_error(e)}", file=sys.stderr)
        return EXIT_FAILED
    if isinstance(e, (CLIError, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
                      PermissionError)):  # PolicyError, ConfigError, CheckpointError, RunMismatch ...
        print(f"maskahead {cmd}: error: {describe_error(e)}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(e, OSError):  # e.g. a full disk while writing results
        print(f"maskahead {cmd}: error: {describe_error(e)}", file=sys.stderr)
        return EXIT_FAILED
    raise e


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The `maskahead` command; returns the exit status (EXIT_STATUS)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = bool(os.environ.get("MASKAHEAD_TRACEBACK"))
    if argv and argv[0] == "convert":
        return convert.run(argv[1:], debug)
    args = build_parser().parse_args(argv)  # usage errors: argparse's one line, exit 2
    try:
        if debug:  # Ctrl-C raises KeyboardInterrupt, for its traceback
            return args.run(args)
        from .. import interrupt

        # Ctrl-C: exit 130 at once once the files are flushed, never unwinding through XLA
        with interrupt.handle_sigint(lambda: interrupted_message(args)):
            return args.run(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"\nmaskahead {args.cmd}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        if debug:
            raise
        return _exit_status(args.cmd, e)
