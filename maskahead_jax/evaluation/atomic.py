"""Atomic file writes for the harness's outputs (summary / budgets / run JSON, tables, plots,
the profile JSON): write a hidden temporary file in the destination's folder, flush and fsync
it, then `os.replace` it over the destination. A full disk or an interruption leaves the old
file (or none), never a truncated one; the temporary file is removed on failure."""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import IO, Iterator

from .. import interrupt

_UMASK = None


def _umask() -> int:
    global _UMASK
    if _UMASK is None:
        _UMASK = os.umask(0)
        os.umask(_UMASK)
    return _UMASK


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """`with atomic_open(path) as f: f.write(...)`: `path` appears, complete, when the block ends
    without an exception; otherwise it is left as it was. mode: "w" (text) or "wb"."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode 'w' or 'wb', got {mode!r}")
    folder = os.path.dirname(os.path.abspath(path))
    with interrupt.critical():  # Ctrl-C (interrupt.py) waits for the file to be in place
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
        try:
            with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual mode
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _fsync_dir(folder)


def write_text(path: str, text: str) -> str:
    with atomic_open(path, "w") as f:
        f.write(text)
    return path


def write_json(path: str, obj, **kw) -> str:
    kw.setdefault("indent", 1)
    with atomic_open(path, "w") as f:
        json.dump(obj, f, **kw)
    return path


def savefig(fig, path: str, **kw) -> str:
    """fig.savefig to `path` atomically (the format from the path's extension, default png)."""
    ext = os.path.splitext(path)[1].lstrip(".").lower() or "png"
    kw.setdefault("format", ext)
    with atomic_open(path, "wb") as f:
        fig.savefig(f, **kw)
    return path
