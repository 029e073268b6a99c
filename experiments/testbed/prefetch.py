"""Batches built ahead of the training step in spawned CPU processes (--workers), so that an
accelerator does not wait for the Python data generators."""
from __future__ import annotations

import os

from maskahead_jax import tasks as T

from .data import make_batch

_WORKER = {}


def _worker_init(args):
    _WORKER["tok"] = T.build_tokenizer()
    _WORKER["args"] = args


def _worker_batch(step: int, B: int, L: int, dense: float):
    return make_batch(step, _WORKER["args"].seed, B, L, _WORKER["tok"], _WORKER["args"], dense)


class BatchPrefetcher:
    """Builds batches in `workers` spawned CPU processes, `ahead` steps in advance.

    Batch contents depend only on (seed, step, B, L, dense), so a prefetched batch equals the one
    make_batch would build inline. `get` takes the current stage's schedule, shape_of(step) ->
    (B, L, dense), and queues each future step with its own shape, so a stage that alternates
    lengths step by step is prefetched as well as a one-length stage; at a stage change the queued
    batches whose shape the new schedule no longer gives are dropped and built again."""

    def __init__(self, args, workers: int, ahead: int = 0):
        import multiprocessing as mp

        saved = os.environ.get("JAX_PLATFORMS")
        os.environ["JAX_PLATFORMS"] = "cpu"  # the workers never touch the accelerator
        try:
            self.pool = mp.get_context("spawn").Pool(workers, _worker_init, (args,))
        finally:
            if saved is None:
                os.environ.pop("JAX_PLATFORMS")
            else:
                os.environ["JAX_PLATFORMS"] = saved
        self.ahead = ahead or 2 * workers
        self.queue = []  # [(step, (B, L, dense), AsyncResult)], consecutive steps

    def get(self, step: int, shape_of):
        """The batch of `step`; shape_of(s) -> (B, L, dense) is the schedule from `step` on."""
        # keep the queued run of steps from `step` on that the schedule still agrees with
        q = [e for e in self.queue if e[0] >= step]
        keep = 0
        while keep < len(q) and q[keep][0] == step + keep and q[keep][1] == shape_of(step + keep):
            keep += 1
        self.queue = q[:keep]
        nxt = self.queue[-1][0] + 1 if self.queue else step
        while nxt < step + self.ahead:
            shape = shape_of(nxt)
            self.queue.append((nxt, shape, self.pool.apply_async(_worker_batch, (nxt, *shape))))
            nxt += 1
        s, _, res = self.queue.pop(0)
        assert s == step
        return res.get()

    def close(self):
        self.pool.terminate()
