"""Ctrl-C (issue 50): SIGINT during `maskahead eval` / `generate` exits 130 after flushing, never
SIGSEGV inside jaxlib (maskahead_jax/interrupt.py), and the rows written survive. The CLI runs in
a subprocess on the shipped testbed (tiny prompts, batch 1, so rows come fast); the signal lands
mid-run: after the first row of the run appears (the next batch is computing)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _start(args):
    # SIGINT must not be ignored in the child (a shell's background job would inherit SIG_IGN)
    return subprocess.Popen([sys.executable, "-m", "maskahead_jax.cli"] + args, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _lines(path) -> list:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [x for x in f.read().split("\n") if x]


def test_sigint_during_eval_exits_130_and_keeps_rows(tmp_path):
    out = str(tmp_path / "ev")
    res = os.path.join(out, "results.jsonl")
    args = ["eval", "--suite", "--tasks", "passkey", "--lengths", "128", "--depths", "0,0.5,1", "--n", "30",
            "--policies", "dense", "--batch-size", "1", "--out", out, "--no-plots", "--no-progress"]
    for attempt in range(3):  # the same command each time: each run resumes the one it interrupted
        before = len(_lines(res))
        p = _start(args)
        while len(_lines(res)) <= before and p.poll() is None:  # a row of this run is written
            time.sleep(0.05)
        assert p.poll() is None, p.communicate()
        saved = _lines(res)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=300)
        assert p.returncode == 130, (attempt, p.returncode, err[-2000:])  # not -11 (SIGSEGV)
        rows = [json.loads(x) for x in _lines(res)]  # every line whole
        assert _lines(res)[:len(saved)] == saved  # nothing written before the signal is lost
        ids = [r["id"] for r in rows]
        assert len(ids) == len(set(ids)) and len(rows) > before
        assert err.strip().splitlines()[-1] == (f"maskahead eval: interrupted; {len(rows)} rows saved in {res}, "
                                                f"rerun the same command to resume")
        assert "Traceback" not in err and not os.path.exists(os.path.join(out, ".lock"))


def test_sigint_during_generate_exits_130(tmp_path):
    prompt = "the pass key is 123 . " * 200 + "what is the pass key ?"
    p = _start(["generate", "--prompt", prompt, "--max-new-tokens", "2000"])
    time.sleep(4)  # loading or generating (far from done): either way 130
    assert p.poll() is None, p.communicate()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 130, (p.returncode, err[-2000:])
    assert err.strip().splitlines()[-1] == "maskahead generate: interrupted" and "Traceback" not in err
