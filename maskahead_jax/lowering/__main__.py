"""`python -m maskahead_jax.lowering compile-worker`: the memory plan's compile worker, run by
compiles._compile_in_subprocess in a child process with forced CPU devices."""
import sys

from .compiles import _compile_worker

if __name__ == "__main__":  # the plan's compile worker (memory_plan runs it in a child process)
    if sys.argv[1:] == ["compile-worker"]:
        sys.exit(_compile_worker())
    sys.exit("usage: python -m maskahead_jax.lowering compile-worker  (or: maskahead lower ...)")
