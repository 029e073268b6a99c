"""Multi-process (multi-host) setup: a thin wrapper around `jax.distributed.initialize`.

Call `initialize()` once per process, before anything else touches JAX devices; afterwards
`jax.devices()` lists the devices of every process, `maskahead_jax.sharding.make_mesh` builds
the mesh over all of them, and `generate(..., mesh=mesh)` runs the same program everywhere
(every process must call it with the same prompts; each gets the full result).

Environment variables (read when the arguments are not given):

    MASKAHEAD_COORDINATOR    host:port of process 0's coordinator service (e.g. 10.0.0.1:12355)
    MASKAHEAD_NUM_PROCESSES  total number of processes
    MASKAHEAD_PROCESS_ID     this process's index in [0, num_processes)
    MASKAHEAD_LOCAL_DEVICES  optional comma-separated local device ids this process uses
    MASKAHEAD_CPU_COLLECTIVES  CPU cross-process collectives: gloo (default) or mpi

With none of them set and no arguments, `jax.distributed.initialize()` is called bare, which
auto-detects Cloud TPU, SLURM, Open MPI and Kubernetes (JobSet) clusters. On a single
process with none of them set, `initialize(required=False)` does nothing.

CPU: JAX runs cross-process collectives on CPU through gloo (the default of
`jax_cpu_collectives_implementation` in jax 0.10.x); the option must be set before the CPU
backend starts, which `initialize` does.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence, Union

import jax

ENV_COORDINATOR = "MASKAHEAD_COORDINATOR"
ENV_NUM_PROCESSES = "MASKAHEAD_NUM_PROCESSES"
ENV_PROCESS_ID = "MASKAHEAD_PROCESS_ID"
ENV_LOCAL_DEVICES = "MASKAHEAD_LOCAL_DEVICES"
ENV_CPU_COLLECTIVES = "MASKAHEAD_CPU_COLLECTIVES"

_initialized = False


def initialize(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None,
               local_device_ids: Optional[Union[int, Sequence[int]]] = None,
               cpu_collectives: Optional[str] = None, required: bool = True,
               initialization_timeout: int = 300) -> bool:
    """Initialise multi-process JAX; returns True if `jax.distributed.initialize` was called.

    Arguments override the MASKAHEAD_* environment variables above. With required=False and
    nothing configured (single process) it does nothing and returns False. Calling it twice
    is a no-op.
    """
    global _initialized
    if _initialized:
        return True
    env = os.environ
    coordinator_address = coordinator_address or env.get(ENV_COORDINATOR)
    if num_processes is None and env.get(ENV_NUM_PROCESSES):
        num_processes = int(env[ENV_NUM_PROCESSES])
    if process_id is None and env.get(ENV_PROCESS_ID):
        process_id = int(env[ENV_PROCESS_ID])
    if local_device_ids is None and env.get(ENV_LOCAL_DEVICES):
        local_device_ids = [int(i) for i in env[ENV_LOCAL_DEVICES].split(",") if i]
    configured = coordinator_address is not None or num_processes is not None or process_id is not None
    if not configured and not required:
        return False
    impl = cpu_collectives or env.get(ENV_CPU_COLLECTIVES)
    if impl:
        jax.config.update("jax_cpu_collectives_implementation", impl)
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, local_device_ids=local_device_ids,
                               initialization_timeout=initialization_timeout)
    _initialized = True
    return True


def shutdown() -> None:
    """`jax.distributed.shutdown()` if `initialize` ran."""
    global _initialized
    if _initialized:
        jax.distributed.shutdown()
        _initialized = False


def is_main_process() -> bool:
    return jax.process_index() == 0
