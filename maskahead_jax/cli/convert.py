"""`maskahead convert SRC DST`: the destination checked up front, then converters.load.cli_convert
(which has its own parser: `maskahead convert -h`)."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from .args import can_create_in
from .errors import EXIT_INTERRUPTED, EXIT_USAGE, CLIError


class _QuietParser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)


def precheck(argv: Sequence[str]) -> Optional[str]:
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
        can_create_in(os.path.dirname(os.path.abspath(a.dst)), f"destination {a.dst}")
    except CLIError as e:
        return str(e)
    return None


def run(argv: Sequence[str], debug: bool = False) -> int:
    """`maskahead convert ARGV`; converters are imported only here (they sit above the library)."""
    err = precheck(argv)
    if err:
        print(f"maskahead convert: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    from converters.load import cli_convert

    try:
        return cli_convert(list(argv))
    except KeyboardInterrupt:
        if debug:
            raise
        print("\nmaskahead convert: interrupted (the destination is left as it was)", file=sys.stderr)
        return EXIT_INTERRUPTED
