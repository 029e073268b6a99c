"""Ctrl-C for the `maskahead` commands: exit 130 at once, after the files are flushed, never a
crash inside jaxlib.

Raising KeyboardInterrupt in a process that runs XLA is unsafe: the main thread only sees it when
the running computation returns (minutes, for a long batch), and the interpreter then tears down
while XLA's worker threads are still live, which can end in SIGSEGV (issue 50). Instead, while
`handle_sigint` is active, SIGINT reaches a watcher thread through `signal.set_wakeup_fd` (written by
the C-level handler the moment the signal arrives, whatever the main thread is doing); the
watcher waits for any `critical()` section in progress (a batch of result rows being written and
fsync'ed, an atomic file replace), runs the cleanups registered with `on_exit` (e.g. removing a
lock file), prints the command's message, flushes stdout / stderr and leaves with
`os._exit(130)`: no interpreter teardown, no exception unwinding through XLA.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Callable, Iterator, Optional

EXIT_INTERRUPTED = 130

_LOCK = threading.RLock()  # held while files are written: an interrupt waits for the write to end
_CLEANUPS: list = []
_STOP = b"\0"


@contextlib.contextmanager
def critical() -> Iterator[None]:
    """A section an interrupt does not cut: the exit waits until it ends."""
    with _LOCK:
        yield


def on_exit(fn: Callable[[], None]) -> Callable[[], None]:
    """Run `fn` when an interrupt ends the process (cleanups; errors ignored). Returns a function
    that unregisters it."""
    _CLEANUPS.append(fn)

    def remove():
        with contextlib.suppress(ValueError):
            _CLEANUPS.remove(fn)
    return remove


def _exit(message: Callable[[], Optional[str]]) -> None:
    with _LOCK:  # a batch of rows being written finishes first
        for fn in list(_CLEANUPS):
            with contextlib.suppress(BaseException):
                fn()
        with contextlib.suppress(BaseException):
            text = message()
            with contextlib.suppress(BaseException):
                sys.stdout.flush()
            if text:
                sys.stderr.write("\n" + text + "\n")
            sys.stderr.flush()
        os._exit(EXIT_INTERRUPTED)


@contextlib.contextmanager
def handle_sigint(message: Callable[[], Optional[str]]) -> Iterator[bool]:
    """Within the block, Ctrl-C ends the process with exit status 130 as the module docstring
    says; `message()` gives the line printed on stderr. Yields False (and changes nothing) where
    signals cannot be handled this way: off the main thread, or SIGINT ignored by the parent."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None)):
        yield False
        return
    r, w = os.pipe()
    os.set_blocking(w, False)
    old_handler = signal.getsignal(signal.SIGINT)
    try:
        old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except (ValueError, OSError):
        os.close(r)
        os.close(w)
        yield False
        return

    def watch():
        while True:
            try:
                data = os.read(r, 64)
            except InterruptedError:
                continue
            except OSError:
                return
            if not data or _STOP in data:
                return
            if bytes([signal.SIGINT]) in data:
                _exit(message)

    # the Python-level handler runs on the main thread between bytecodes: it does nothing (the
    # watcher acts); it only has to be a Python function for the wakeup fd to be written
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    t = threading.Thread(target=watch, name="maskahead-sigint", daemon=True)
    t.start()
    try:
        yield True
    finally:
        signal.signal(signal.SIGINT, old_handler)
        signal.set_wakeup_fd(old_fd)
        with contextlib.suppress(OSError):
            os.write(w, _STOP)
        t.join(timeout=5)
        os.close(w)
        os.close(r)
