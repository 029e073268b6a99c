"""Benchmark one generate configuration and print JSON.

    python experiments/bench_generate.py [--model DIR] --batch 4 --prompt-len 1024 --gen-len 128 \
        [--policy dense|maskahead|...] [--capacity 10]

Reports tokens/s (end to end and decode stage), NFE, tokens per forward, compile time (split into
trace + lowering and XLA's compile), prefill and decode wall times, and peak/final KV bytes with the
bf16 dense-equivalent, for one batch of random prompts (token ids drawn from the model's vocabulary,
specials excluded). Every phase is compiled before it is timed (see generate._timed_run). The
default model is the shipped testbed.

--sweep-prompt-lens 500,510,1000,1020 also runs generate (untimed) at each of those prompt lengths,
as an evaluation sweep does, and reports how many programs the generate cores compiled against how
many (batch, prompt-length bucket) pairs the sweep visited (`sweep.core_compiles` should equal
`sweep.buckets`), plus XLA's backend compiles of the whole run (every jitted op, from
jax.monitoring).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from maskahead_jax import GenerationConfig, load_pretrained  # noqa: E402
from maskahead_jax.engine.generate import core_compiles, prompt_bucket  # noqa: E402
from maskahead_jax.generate import generate  # noqa: E402
from maskahead_jax.policies import make  # noqa: E402

TESTBED = os.path.join(ROOT, "maskahead_jax", "testbed")
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=TESTBED)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--policy", default="dense")
    ap.add_argument("--capacity", type=float, default=None, help="capacity %% for evicting policies")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention", default="auto", help="GenerationConfig.attention: auto | reference | kernels")
    ap.add_argument("--sweep-prompt-lens", default="",
                    help="comma-separated prompt lengths for the compile-count sweep (untimed runs)")
    a = ap.parse_args(argv)
    backend_compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: backend_compiles.append(secs) if event == BACKEND_COMPILE else None)
    model = load_pretrained(a.model, dtype=a.dtype)
    cfg = model.config
    specials = {cfg.mask_token_id, cfg.pad_token_id, *cfg.eos_token_ids}
    vocab = np.array([t for t in range(min(cfg.vocab_size, 50_000)) if t not in specials])
    rng = np.random.RandomState(a.seed)
    prompts = [list(map(int, rng.choice(vocab, a.prompt_len))) for _ in range(a.batch)]
    policy = make(a.policy, capacity_pct=a.capacity)
    gc = GenerationConfig(max_new_tokens=a.gen_len, stop_at_eos=False, timings=True,
                          attention=a.attention)
    out = generate(model, prompts, gc, policy=policy)
    sweep = None
    if a.sweep_prompt_lens:
        lens = [int(x) for x in a.sweep_prompt_lens.split(",")]
        before = core_compiles()
        untimed = GenerationConfig(max_new_tokens=a.gen_len, stop_at_eos=False, attention=a.attention)
        for n in lens:
            generate(model, [list(map(int, rng.choice(vocab, n))) for _ in range(a.batch)], untimed,
                     policy=policy)
        sweep = dict(prompt_lens=lens, buckets=len({prompt_bucket(n, max(64, cfg.block_size)) for n in lens}),
                     core_compiles=core_compiles() - before)
    t, s = out.stats["timings"], out.stats
    n_tok = sum(len(x) for x in out.tokens)
    print(json.dumps(dict(
        model=a.model, policy=a.policy, capacity=a.capacity, batch=a.batch, prompt_len=a.prompt_len,
        gen_len=a.gen_len, attention=a.attention, jax=jax.__version__, backend=jax.default_backend(),
        compile_s=t["compile_s"], trace_lower_s=t["trace_lower_s"], xla_compile_s=t["xla_compile_s"],
        stablehlo_chars=t["stablehlo_chars"],
        prefill_s=t["prefill_s"], decode_s=t["decode_s"],
        total_s=t["total_s"], tokens_per_s=n_tok / t["total_s"],
        decode_tokens_per_s=n_tok / t["decode_s"] if t["decode_s"] else None, nfe=s["nfe_batch"],
        tokens_per_forward=s["tokens_per_forward"], kv_bytes_peak=max(s["kv_bytes_peak"]),
        kv_bytes_final=max(s["kv_bytes_final"]), dense_bytes_final=max(s["dense_bytes_final"]),
        reduction_final=float(np.mean(s["reduction_final"])),
        reduction_peak=float(np.mean(s["reduction_peak"])), sweep=sweep,
        backend_compiles=len(backend_compiles), backend_compile_s=sum(backend_compiles)), indent=1))


if __name__ == "__main__":
    main()
