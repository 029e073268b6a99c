"""Systems profile: prefill, decode-stage and end-to-end time, peak KV memory and serving
capacity for dense / MaskAhead / Q-MaskAhead, side by side in one run: a dict (`profile`), shown
as a table (`format_table`; `maskahead profile` prints it and writes the JSON to --out).

    maskahead profile --model maskahead_jax/testbed --prompt-len 8192 --out-len 256 --batch 1,8,32
    maskahead profile --shape fast-dllm-v2-7b --prompt-len 8192 --out-len 256 --batch 1,8,32

Method (same prompt replicated over the batch, fixed output length: stop at EOS off):
  * every (policy, batch) is run once untimed first (the jit compile), then `repeats` times;
    the median is reported;
  * prefill_s  = wall time of a run with max_new_tokens = one block (prefill + the first block;
    the jitted core has no host sync between them, so the two are not split further);
  * e2e_s      = wall time of the full run;  decode_s = e2e_s - prefill_s, or None with a
    `timing_note` when timing noise makes it <= 0 (never a negative or clamped time);
  * decode_ms_per_forward = decode_s / (forwards of the full run - forwards of the prefill run);
  * decode_tok_s = generated tokens beyond the prefill run / decode_s;
  * peak KV = the engine's memory accounting (research/maskahead.md §4), summed over the batch;
  * speedups = dense time / policy time, same run, same batch; the baseline is the run named
    plain "dense" (the default attention: fused kernels on a GPU / TPU).
Attention implementations side by side: a policy written "name@impl" runs with
GenerationConfig(attention=impl) (auto | reference | kernels | pallas_gpu | pallas_triton | ...),
e.g. `--policies dense@reference,dense,maskahead` puts the unfused XLA dense baseline beside the
fused one; each run records the implementation it resolved to (`attention`).
Roofline of the decode forward (`decode_roofline`, per run when `peak_flops` / `hbm_bytes_per_s`
are given; defaults: H200, 790 TFLOP/s realistic dense bf16, 4.8 TB/s HBM):
  * FLOPs = 2 * n * (P_layers + H * V) + 4 * n * L * Hq * D * S, n = batch * block tokens per
    forward, P_layers = L * (H * D * (2 * Hq + 2 * Hkv) + 3 * H * I) the matmul weights, V the vocab
    (logits of every block token), S = the attended context (prompt + out_len / 2 for dense,
    stats['live_entries'] (kept entries at the end, mean over rows) for the others);
  * bytes = 2 * (P_layers + H * V) (bf16 weights, read once) + the KV bytes the forward reads
    (kv_final_bytes of the run: every row's stored cache);
  * roofline_s = max(FLOPs / peak_flops, bytes / hbm_bytes_per_s); roofline_fraction = roofline_s /
    measured decode s per forward (1.0 = at the roofline).
Serving capacity: the largest batch whose peak KV bytes (per row, which scale linearly with the
batch) fit `kv_budget_gb`, per policy.

A library module (the command line is `maskahead profile`, in cli/profile.py); `python -m
maskahead_jax.profile ARGS` runs `maskahead profile ARGS`.
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from typing import Optional, Sequence

import numpy as np

from .config import FAMILY_DEFAULTS, GenerationConfig, ModelConfig

# research/models.md §1.1, §2.1, §4.1, §5
SHAPES = {
    "fast-dllm-v2-7b": dict(family="fast_dllm_v2", layout="qwen2", vocab_size=152064, hidden_size=3584,
                            num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                            intermediate_size=18944, qkv_bias=True, rope_theta=1e6,
                            max_position_embeddings=32768),
    "sdar-8b": dict(family="sdar", layout="qwen3", vocab_size=151936, hidden_size=4096, num_layers=36,
                    num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=12288, qk_norm=True,
                    rope_theta=1e6, max_position_embeddings=32768),
    "llada2-mini": dict(family="llada2", layout="llada2", vocab_size=157184, hidden_size=2048, num_layers=20,
                        num_heads=16, num_kv_heads=4, head_dim=128, intermediate_size=5120, qk_norm=True,
                        rotary_dim=64, rope_theta=600000.0, num_experts=256, num_experts_per_tok=8,
                        moe_intermediate_size=512, num_shared_experts=1, first_k_dense_replace=1,
                        n_group=8, topk_group=4, routed_scaling_factor=2.5, max_position_embeddings=32768),
    # research/models.md §4.1: plain MHA, fully bidirectional, trained to 4096 positions
    "llada-8b": dict(family="llada", layout="llada", vocab_size=126464, hidden_size=4096, num_layers=32,
                     num_heads=32, num_kv_heads=32, head_dim=128, intermediate_size=12288, rms_eps=1e-5,
                     rope_theta=500000.0, max_position_embeddings=4096),
}
SHAPE_PRESET = {"fast-dllm-v2-7b": "fast-dllm-v2", "sdar-8b": "sdar", "llada2-mini": "llada2-mini"}


def shape_config(name: str, num_layers: Optional[int] = None) -> ModelConfig:
    """ModelConfig of a named real-model shape (optionally with fewer layers for a smoke run)."""
    key = name.lower()
    if key not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; choose one of {sorted(SHAPES)}")
    kw = dict(SHAPES[key])
    attn, shift, rule, mask_id, eos, thr = FAMILY_DEFAULTS[kw["family"]]
    kw.update(attention=attn, logits_shift=shift, commit_rule=rule, mask_token_id=mask_id,
              eos_token_ids=tuple(eos), pad_token_id=eos[0], threshold=thr, block_size=32)
    if num_layers:
        kw["num_layers"] = int(num_layers)
        kw["first_k_dense_replace"] = min(kw.get("first_k_dense_replace", 0), int(num_layers))
    return ModelConfig(**kw)


def random_model(cfg: ModelConfig, seed: int = 0, dtype="bfloat16"):
    """Random bf16 weights for a shape (maskahead_jax.model.init_params)."""
    import jax
    import jax.numpy as jnp

    from .api import Model
    from .model import init_params

    return Model(cfg, init_params(cfg, jax.random.PRNGKey(seed), dtype=jnp.dtype(dtype)))


def _prompt(cfg: ModelConfig, n: int, seed: int) -> list:
    r = np.random.default_rng(seed)
    bad = {cfg.mask_token_id, *cfg.eos_token_ids, cfg.pad_token_id}
    hi = cfg.vocab_size
    ids = r.integers(5, hi, size=n * 2)
    return [int(t) for t in ids if int(t) not in bad and int(t) < cfg.vocab_size][:n]


H200_PEAK_FLOPS = 790e12  # realistic dense bf16 (device docs); 989e12 is the spec sheet figure
H200_HBM_BYTES_PER_S = 4.8e12


def decode_roofline(cfg: ModelConfig, batch: int, block: int, context: float, kv_bytes: float,
                    peak_flops: float = H200_PEAK_FLOPS, hbm_bytes_per_s: float = H200_HBM_BYTES_PER_S) -> dict:
    """FLOPs, bytes read and roofline time of one decode forward (formula: module docstring).

    context: attended entries per lane; kv_bytes: the KV bytes the forward reads (all rows)."""
    h, d, hq, hkv, n_l = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.num_layers
    inter = cfg.intermediate_size
    p_layers = n_l * (h * d * (2 * hq + 2 * hkv) + 3 * h * inter)
    p_all = p_layers + h * cfg.vocab_size
    n = batch * block
    flops = 2.0 * n * p_all + 4.0 * n * n_l * hq * d * context
    nbytes = 2.0 * p_all + float(kv_bytes)
    t = max(flops / peak_flops, nbytes / hbm_bytes_per_s)
    return dict(flops=flops, bytes=nbytes, roofline_s=t, bound="compute" if flops / peak_flops >= nbytes / hbm_bytes_per_s
                else "bandwidth", peak_flops=peak_flops, hbm_bytes_per_s=hbm_bytes_per_s)


def _timed(model, prompts, cfg, policy, repeats, mesh=None):
    from .generate import generate

    times, out = [], None
    for i in range(1 + max(1, repeats)):  # the first run compiles (untimed); one call site: one BudgetWarning
        t0 = time.perf_counter()
        out = generate(model, prompts, cfg, policy, mesh=mesh)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def profile(model, prompt_len: int, out_len: int, batch_sizes: Sequence[int],
            policies: Sequence[str] = ("dense", "maskahead", "q-maskahead"), capacity: float = 10.0,
            gen: Optional[GenerationConfig] = None, repeats: int = 1, kv_budget_gb: float = 40.0,
            seed: int = 0, log=None, policy_kw: Optional[dict] = None, mesh=None,
            peak_flops: float = H200_PEAK_FLOPS, hbm_bytes_per_s: float = H200_HBM_BYTES_PER_S) -> dict:
    """Profile every policy at every batch size; see the module docstring for the method.

    policy_kw: knobs as `maskahead_jax.evaluation.policies.resolve_policy_kw` takes them
    (unprefixed: every policy that has the knob; "name:knob": that policy only). Every policy is
    built and validated against the model before the first run (PolicyError otherwise); a
    (policy, batch) run that fails (e.g. out of memory) is listed under `skipped`."""
    import jax

    log = sys.stderr if log is None else log  # (read when called: a redirected stderr is honoured)
    cfg: ModelConfig = model.config
    gen = gen or GenerationConfig()
    bs = gen.block_size or cfg.block_size
    _check_sizes(prompt_len, out_len, batch_sizes, bs)
    pols = build_policies(cfg, gen, policies, capacity, out_len, policy_kw)
    prompt = _prompt(cfg, prompt_len, seed)
    full = dataclasses.replace(gen, max_new_tokens=out_len, stop_at_eos=False)
    pre = dataclasses.replace(gen, max_new_tokens=bs, stop_at_eos=False)
    res = dict(prompt_len=prompt_len, out_len=out_len, batch_sizes=list(batch_sizes), capacity_pct=capacity,
               repeats=repeats, backend=jax.default_backend(), device=str(jax.devices()[0]),
               dtype=str(model.params["embed"].dtype), block_size=bs, runs=[], skipped=[], serving={})
    per_row_peak = {}
    for b in batch_sizes:
        prompts = [prompt] * int(b)
        batch_runs = []
        for p, pol in pols.items():
            attn = split_attention(p)[1] or gen.attention
            try:
                t_pre, o_pre = _timed(model, prompts, dataclasses.replace(pre, attention=attn), pol, repeats, mesh)
                t_e2e, o = _timed(model, prompts, dataclasses.replace(full, attention=attn), pol, repeats, mesh)
            except Exception as e:  # e.g. out of memory at a large batch
                res["skipped"].append(dict(policy=p, batch=b, reason=f"{type(e).__name__}: {str(e)[:300]}"))
                continue
            run = _run_record(cfg, p, b, attn, mesh, t_pre, o_pre, t_e2e, o)
            _add_roofline(run, cfg, p, b, bs, prompt_len, out_len, o.stats, peak_flops, hbm_bytes_per_s)
            _add_device_peak(run)
            per_row_peak[p] = max(o.stats["kv_bytes_peak"])
            if run["decode_s"] is None:
                run["timing_note"] = (f"e2e time {t_e2e:.4f}s <= prefill-run time {t_pre:.4f}s: timing noise "
                                      f"(a busy machine?); decode times not reported; rerun with --repeats 3 "
                                      f"or more")
            batch_runs.append(run)
            res["runs"].append(run)
            decode = f"{run['decode_s']:.3f}s" if run["decode_s"] is not None else "n/a (timing noise)"
            print(f"[profile] {p} batch={b}: prefill {t_pre:.3f}s decode {decode} e2e {t_e2e:.3f}s "
                  f"peak KV {run['kv_peak_bytes'] / 2**20:.1f} MiB", file=log, flush=True)
        _speedups(batch_runs)
    res["serving"] = serving_capacity(per_row_peak, kv_budget_gb)
    return res


def _check_sizes(prompt_len: int, out_len: int, batch_sizes: Sequence[int], bs: int) -> None:
    """ValueError for sizes `profile` cannot measure (before any policy is built)."""
    if out_len <= bs:
        raise ValueError(f"out_len {out_len} must exceed one block ({bs}) to split prefill and decode")
    if prompt_len <= 0:
        raise ValueError("prompt_len must be positive")
    if not batch_sizes or any(int(b) <= 0 for b in batch_sizes):
        raise ValueError(f"batch sizes must be positive integers, got {list(batch_sizes)}")


def _run_record(cfg: ModelConfig, p: str, b, attn, mesh, t_pre: float, o_pre, t_e2e: float, o) -> dict:
    """One (policy, batch) run's times, forwards, throughputs and KV bytes from its prefill run
    and its full run (decode_s None when timing noise makes it <= 0), and its per-device KV share
    under a mesh."""
    from .kernels.attention import resolve as resolve_attention

    st = o.stats
    fw = max(1, st["nfe_batch"] - o_pre.stats["nfe_batch"])
    tok_dec = sum(len(t) for t in o.tokens) - sum(len(t) for t in o_pre.tokens)
    dec = t_e2e - t_pre
    ok = dec > 0
    impl = "reference" if mesh is not None and attn == "auto" else resolve_attention(attn)
    run = dict(policy=p, batch=int(b), attention=impl, prefill_s=t_pre, decode_s=dec if ok else None, e2e_s=t_e2e,
               forwards=st["nfe_batch"], decode_forwards=fw,
               decode_ms_per_forward=1e3 * dec / fw if ok else None,
               decode_tok_s=tok_dec / dec if ok else None,
               e2e_tok_s=sum(len(t) for t in o.tokens) / t_e2e,
               kv_peak_bytes=float(sum(st["kv_bytes_peak"])),
               dense_peak_bytes=float(sum(st["dense_bytes_peak"])),
               kv_final_bytes=float(sum(st["kv_bytes_final"])),
               reduction_peak=float(np.mean(st["reduction_peak"])),
               reduction_final=float(np.mean(st["reduction_final"])))
    if mesh is not None:  # per-device share of the cache under the mesh's rule shardings
        from .sharding import kv_bytes_per_device, make_mesh

        m = make_mesh(mesh) if isinstance(mesh, str) else mesh
        share = kv_bytes_per_device(cfg, int(b), st["cache_capacity"], m)
        run.update(mesh=str(dict(m.shape)), kv_shards=share["shards"],
                   kv_peak_bytes_per_device=run["kv_peak_bytes"] / share["shards"])
    return run


def _add_roofline(run: dict, cfg: ModelConfig, p: str, b, bs: int, prompt_len: int, out_len: int, st: dict,
                  peak_flops: float, hbm_bytes_per_s: float) -> None:
    """The run's decode-forward roofline (`decode_roofline`) and its fraction of the measured
    ms per forward, into `run`."""
    ctx_len = float(prompt_len + out_len / 2)
    if split_attention(p)[0] != "dense" and st.get("live_entries"):  # the kept entries per lane at the end
        ctx_len = min(ctx_len, float(np.mean(st["live_entries"])))
    roof = decode_roofline(cfg, int(b), bs, ctx_len, run["kv_final_bytes"], peak_flops, hbm_bytes_per_s)
    run.update(roofline_flops=roof["flops"], roofline_bytes=roof["bytes"], roofline_ms=1e3 * roof["roofline_s"],
               roofline_bound=roof["bound"], roofline_context=ctx_len,
               roofline_fraction=(roof["roofline_s"] * 1e3 / run["decode_ms_per_forward"]
                                  if run["decode_ms_per_forward"] else None))


def _add_device_peak(run: dict) -> None:
    """The device's peak bytes in use so far into `run` (None where the backend does not report)."""
    import jax

    try:
        ms = jax.devices()[0].memory_stats() or {}
        run["peak_device_bytes"] = ms.get("peak_bytes_in_use")
    except Exception:  # CPU backends may not report
        run["peak_device_bytes"] = None


def split_attention(label: str) -> tuple:
    """"maskahead@reference" -> ("maskahead", "reference"); "dense" -> ("dense", None)."""
    name, _, attn = label.partition("@")
    return name, (attn.strip() or None)


def _speedups(runs: list) -> None:
    """Speedups of one batch's runs against its plain "dense" run (when it ran)."""
    base = next((r for r in runs if r["policy"] == "dense"), None)
    if base is None:
        return
    for r in runs:
        ok = r["decode_s"] is not None and base["decode_s"]
        r.update(speedup_decode=base["decode_s"] / r["decode_s"] if ok else None,
                 speedup_e2e=base["e2e_s"] / r["e2e_s"], speedup_prefill=base["prefill_s"] / r["prefill_s"])


def build_policies(cfg: ModelConfig, gen: GenerationConfig, policies: Sequence[str], capacity: Optional[float],
                   out_len: int, policy_kw: Optional[dict] = None) -> dict:
    """{name: policy} for a profile, each built (budgetless policies without the capacity) and
    validated against `cfg` and the resolved generation config: PolicyError before any run."""
    from .evaluation.policies import make_policy, resolve_policy_kw, run_label, takes_budget, validate_policy

    from .kernels.attention import resolve as resolve_attention

    names = [split_attention(p)[0] for p in policies]
    per = resolve_policy_kw(names, policy_kw)
    resolved = dataclasses.replace(gen, max_new_tokens=out_len, stop_at_eos=False).resolve(cfg)
    pols = {}
    for label_in, p in zip(policies, names):
        attn = split_attention(label_in)[1]
        if attn is not None:
            resolve_attention(attn)  # an unknown implementation: ValueError naming the valid ones
        if label_in in pols:
            raise ValueError(f"policy {label_in!r} listed twice")
        key = p.strip().lower().replace("_", "-")
        cap = capacity if takes_budget(key) else None
        label = run_label(p, cap)
        pol = make_policy(p, cap, **per[key])
        validate_policy(pol, cfg, resolved, label)
        pols[label_in] = pol
    return pols


def _num(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _bytes(v) -> str:
    if v is None:
        return "-"
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if v >= scale:
            return f"{v / scale:.2f} {unit}"
    return f"{v:.0f} B"


def _aligned(header: Sequence[str], rows: Sequence[Sequence[str]], right_from: int = 1) -> list:
    """Plain-text columns: the first `right_from` left-aligned, the rest right-aligned."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(r):
        return "  ".join(str(c).ljust(w) if i < right_from else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    return [line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows]


def format_table(res: dict) -> str:
    """A profile result (`profile`'s dict) as a human-readable table: one row per (policy, batch)
    with times, KV memory and speedups vs dense, then the serving capacity, skipped runs and
    timing notes. "-": not measured (a decode time lost in timing noise, no dense baseline)."""
    from .evaluation.policies import takes_budget

    def label(p):
        try:
            budget = takes_budget(split_attention(p)[0])
        except Exception:
            budget = False
        return f"{p} {res['capacity_pct']:g}%" if budget and res.get("capacity_pct") is not None else p

    head = (f"maskahead profile: {res.get('model', 'model')} ({res.get('dtype')} on {res.get('device')}), "
            f"prompt {res['prompt_len']} + {res['out_len']} new tokens, block {res.get('block_size')}, "
            f"median of {res.get('repeats', 1)} timed run(s) after a compile run")
    cols = ["policy", "batch", "prefill s", "decode s", "e2e s", "ms/forward", "decode tok/s", "e2e tok/s",
            "peak KV", "final KV", "KV reduction", "decode x", "e2e x"]
    rows = []
    for r in res.get("runs", []):
        rows.append([label(r["policy"]) + (f" [{r['attention']}]" if r.get("attention") else ""), str(r["batch"]), _num(r["prefill_s"], ".3f"), _num(r["decode_s"], ".3f"),
                     _num(r["e2e_s"], ".3f"), _num(r["decode_ms_per_forward"], ".1f"),
                     _num(r["decode_tok_s"], ".0f"), _num(r.get("e2e_tok_s"), ".0f"),
                     _bytes(r["kv_peak_bytes"]), _bytes(r["kv_final_bytes"]),
                     _num(r.get("reduction_final"), ".2f") + "x",
                     _num(r.get("speedup_decode"), ".2f"), _num(r.get("speedup_e2e"), ".2f")])
    out = [head, ""] + (_aligned(cols, rows, right_from=1) if rows else ["(no run finished)"])
    serving = {k: v for k, v in res.get("serving", {}).items() if isinstance(v, dict)}
    if serving:
        srows = [[label(p), _bytes(v["per_row_peak_bytes"]), str(v["max_batch"]),
                  _num(v.get("vs_dense"), ".2f") + ("x" if v.get("vs_dense") is not None else "")]
                 for p, v in serving.items()]
        out += ["", f"serving capacity in {res['serving']['kv_budget_gb']:g} GiB of KV "
                    f"(peak KV per row; rows scale linearly):"]
        out += _aligned(["policy", "peak KV / row", "max batch", "vs dense"], srows)
    notes = [f"{r['policy']} batch {r['batch']}: {r['timing_note']}" for r in res.get("runs", [])
             if r.get("timing_note")]
    notes += [f"{sk['policy']} batch {sk.get('batch')} skipped: {sk['reason']}" for sk in res.get("skipped", [])]
    if notes:
        out += [""] + [f"note: {n}" for n in notes]
    return "\n".join(out)


def serving_capacity(per_row_peak_bytes: dict, kv_budget_gb: float) -> dict:
    """{policy: per-row peak bytes} -> the largest batch whose KV fits kv_budget_gb (GiB)."""
    budget = kv_budget_gb * 2 ** 30
    out = {"kv_budget_gb": kv_budget_gb}
    for p, v in per_row_peak_bytes.items():
        out[p] = dict(per_row_peak_bytes=float(v), max_batch=int(budget // max(float(v), 1.0)))
    if "dense" in per_row_peak_bytes:
        d = out["dense"]["max_batch"]
        for p in per_row_peak_bytes:
            out[p]["vs_dense"] = out[p]["max_batch"] / max(d, 1)
    return out


if __name__ == "__main__":  # `python -m maskahead_jax.profile ARGS` = `maskahead profile ARGS`
    import runpy

    sys.argv[1:1] = ["profile"]
    runpy.run_module("maskahead_jax.cli", run_name="__main__", alter_sys=True)
