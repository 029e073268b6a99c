"""The training clock and schedule: `ActiveClock` (training time that a stopped process does not
spend), the length curriculum (`parse_stages`, gated `curriculum`, per-step shapes) and the
learning rate (`learning_rate`: linear warm-up, then cosine decay to 10% or constant)."""
from __future__ import annotations

import math
import time


class ActiveClock:
    """Seconds of this process's life, leaving out the time it spent stopped (SIGSTOP, a suspended
    machine), so that pausing a run does not spend its --minutes budget.

    A daemon thread wakes every `tick` seconds; a gap longer than `gap` between two wake-ups can only
    mean the whole process was not running, and that gap (less one tick) is left out. Reading the
    clock just after a resume may still include the pause; the next reading takes it back, so sums of
    differences are right. A thread starved for longer than `gap` also reads as stopped (harmless:
    the run trains a little longer)."""

    def __init__(self, tick: float = 0.5, gap: float = 10.0):
        import threading

        self.tick, self.gap = tick, gap
        self.stopped = 0.0  # seconds left out so far
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="active-clock")
        self._thread.start()

    def _beat(self):
        last = time.monotonic()
        while not self._done.wait(self.tick):
            now = time.monotonic()
            if now - last > self.gap:
                with self._lock:
                    self.stopped += now - last - self.tick
            last = now

    def __call__(self) -> float:
        with self._lock:
            return time.monotonic() - self.stopped

    def close(self):
        self._done.set()
        self._thread.join()


def curriculum(frac: float, stages, current: int = 0, heldout: float = 1.0, gate: float = 0.0,
               slack: float = 0.15) -> int:
    """stages: parse_stages' list of (start_fraction, ((L, B), ...), packed). Returns the index
    of the stage to train.

    The next stage is entered once its start fraction is reached and the held-out accuracy of the
    current stage is at least `gate` (grow the context only after retrieval appears), or anyway
    `slack` of the budget later, so the run always reaches the long contexts."""
    k = current
    while k + 1 < len(stages) and frac >= stages[k + 1][0] and (
            heldout >= gate or frac >= stages[k + 1][0] + slack):
        k += 1
    return k


def parse_stages(s: str):
    """"start:L:B[:packed],..." -> [(start, ((L, B), ...), packed)]. A stage may alternate
    lengths step by step: "0.8:512|2560:8|2:0.3" trains 512 x 8 and 2560 x 2 in turn (keeps the
    short contexts' skills while the long ones are trained; --workers prefetch each step with its
    own shape)."""
    out = []
    for part in s.split(","):
        f = part.split(":")
        if len(f) not in (3, 4):
            raise SystemExit(f"bad stage {part!r}: want start:L:B[:packed]")
        ls, bs = f[1].split("|"), f[2].split("|")
        if len(ls) != len(bs):
            raise SystemExit(f"bad stage {part!r}: {len(ls)} lengths but {len(bs)} batch sizes")
        out.append((float(f[0]), tuple((int(a), int(b)) for a, b in zip(ls, bs)),
                    float(f[3]) if len(f) > 3 else 0.0))
    return out


def stage_shape(stage, step: int):
    """(L, B) of a parsed stage at this step (alternating stages cycle through their lengths)."""
    shapes = stage[1]
    return shapes[step % len(shapes)]


def batch_shape(stage, step: int):
    """(B, L, dense) of a parsed stage's batch at this step: what make_batch and the prefetcher take."""
    L, B = stage_shape(stage, step)
    return B, L, stage[2]


def learning_rate(step: int, frac: float, lr: float, warmup: int, constant: bool = False) -> float:
    """The rate at `step` (0-based) with `frac` of the time budget spent: a linear warm-up over
    `warmup` steps, times a cosine from 1 to 0.1 over the budget (1 throughout when `constant`).
    A run started with --init-from counts its steps from 0 again (a new warm-up); to continue at
    an export's last rate, pass that rate as --lr with --constant-lr."""
    decay = 1.0 if constant else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))
    return lr * min(1.0, (step + 1) / warmup) * decay
