"""Test-wide setup, and a hang guard.

The hang guard: a test still running after HANG_AFTER_S seconds (setup, call and teardown
together; the slowest test takes ~140 s on 2 loaded cores) has its Python threads' stacks
dumped and its process ended by faulthandler (a C watchdog thread: it fires even when the
hang holds the GIL). Under pytest-xdist the run goes on: xdist replaces the worker,
pytest-rerunfailures (pyproject: --reruns 1, no reruns of ordinary failures) runs the crashed
test once more, and the end of the run prints the stacks (terminal summary). Why: CI once sat
silently for over an hour at 98% with no hint of which test hung.
"""
from __future__ import annotations

import faulthandler
import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
from xla_test_flags import with_test_flags  # noqa: E402  (tests/ is on sys.path just above)

os.environ["XLA_FLAGS"] = with_test_flags(os.environ.get("XLA_FLAGS", ""))

HANG_AFTER_S = float(os.environ.get("MASKAHEAD_TEST_HANG_S", 1200))
_DIR_KEY = "maskahead_hang_dir"


def _hang_dir(config) -> str:
    """Where each process writes the dump of the test it is running (one file per process)."""
    winput = getattr(config, "workerinput", None)
    if winput is not None:
        return winput[_DIR_KEY]
    if not hasattr(config, "_maskahead_hang_dir"):
        config._maskahead_hang_dir = tempfile.mkdtemp(prefix="maskahead-hang-")
    return config._maskahead_hang_dir


@pytest.hookimpl(optionalhook=True)  # an xdist hook: absent without xdist or with -p no:xdist
def pytest_configure_node(node):  # xdist controller: hand every worker the dump folder
    node.workerinput[_DIR_KEY] = _hang_dir(node.config)


def pytest_configure(config):
    if getattr(config, "workerinput", None) is None:  # the terminal's stderr, before capture
        config._maskahead_stderr_fd = os.dup(2)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if HANG_AFTER_S <= 0:
        yield
        return
    winput = getattr(item.config, "workerinput", None)
    path = None
    if winput is None:  # one process: the stacks (they name the test) go to the terminal
        dest = item.config._maskahead_stderr_fd
    else:  # a worker: to a file the controller prints at the end
        path = os.path.join(_hang_dir(item.config), f"{winput['workerid']}-{os.getpid()}.txt")
        dest = open(path, "w")
        dest.write(f"{item.nodeid} ran past the hang guard's {HANG_AFTER_S:.0f} s; its threads:\n")
        dest.flush()
    faulthandler.dump_traceback_later(HANG_AFTER_S, exit=True, file=dest)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        if path:
            dest.close()
            os.remove(path)  # finished: nothing to report


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if getattr(config, "workerinput", None) is not None or not hasattr(config, "_maskahead_hang_dir"):
        return
    folder = config._maskahead_hang_dir
    dumps = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    for name in dumps:
        with open(os.path.join(folder, name)) as f:
            terminalreporter.write_sep("=", f"hang guard: {name}")
            terminalreporter.write(f.read() + "\n")
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def _bounded_memory_maps():
    """A worker compiles hundreds of programs, each held in LLVM's own memory mappings until it
    leaves JAX's caches; past the kernel's vm.max_map_count the next compile dies inside XLA
    (the segfaults / aborts in backend_compile_and_load that used to need a rerun). Drop the
    compiled programs after a test that leaves the worker over half the limit
    (maskahead_jax/compile_cache.py)."""
    yield
    from maskahead_jax import compile_cache

    compile_cache.relieve()
