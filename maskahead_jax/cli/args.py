"""The command line's argument types and output-path checks, shared by every subcommand."""
from __future__ import annotations

import argparse
import os
import tempfile
from typing import Optional

from .errors import CLIError


def int_at_least(lo: int):
    def parse(text):
        try:
            v = int(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be {'positive' if lo == 1 else f'>= {lo}'}, got {v}")
        return v
    return parse


def float_in(lo: float, hi: Optional[float], what: str):
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


pos_int = int_at_least(1)
threshold_arg = float_in(0.0, 1.0, "a commit threshold in (0, 1]")
capacity_arg = float_in(0.0, 100.0, "a percentage in (0, 100]")
pos_float = float_in(0.0, None, "must be positive")


def csv_list(text, typ=str) -> list:
    try:
        return [typ(x) for x in str(text).split(",") if x.strip() != ""]
    except ValueError:
        raise CLIError(f"cannot parse {text!r} as a comma-separated list of {typ.__name__}") from None


def pos_ints(text, flag: str) -> list:
    vals = csv_list(text, int)
    if not vals or any(v <= 0 for v in vals):
        raise CLIError(f"{flag} {text}: expected positive integers, comma-separated")
    return vals


def parse_depths(text) -> list:
    vals = csv_list(text, float)
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


def can_create_in(folder: str, what: str) -> None:
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
    can_create_in(path, f"{flag} {path}")


def check_out_file(path: str, flag: str = "--out") -> None:
    """An output file: not a folder, in a folder that is writable or can be created."""
    if path.endswith(("/", os.sep)) or os.path.isdir(path):
        raise CLIError(f"{flag} {path} is a folder; expected a file path, e.g. "
                       f"{os.path.join(path, 'profile.json')}")
    can_create_in(os.path.dirname(os.path.abspath(path)), f"{flag} {path}")

