"""Sharded inference (maskahead_jax.sharding): rules and fallbacks in-process; everything that
needs several devices runs in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count
set before jax initialises (tests/sharding_scripts/*.py, each prints JSON lines).

Run just these:  pytest tests/test_sharding.py -q   (the multi-device parity cases take a few
minutes on 2 CPU cores; `-k "not mp_"` keeps only the fast in-process ones).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from maskahead_jax import cache as kvc
from maskahead_jax import sharding as shd
from maskahead_jax.model import param_shapes
from sharding_scripts.common import COLLECTIVE_FLAGS, STUCK_MARKERS
from tiny import FAMILIES, tiny_model
from xla_test_flags import with_test_flags

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "sharding_scripts")
ALL_FAMILIES = list(FAMILIES)


# Per attempt: the slowest script takes ~140 s on 2 loaded cores. A script prints its stacks and
# exits DUMP_MARGIN_S before the timeout (sharding_scripts/common.py), so a stuck run says where.
ATTEMPT_TIMEOUT_S = 420
DUMP_MARGIN_S = 20


def _env(devices=None, timeout=ATTEMPT_TIMEOUT_S):
    env = dict(os.environ)
    env["MASKAHEAD_DUMP_AFTER_S"] = str(max(1, timeout - DUMP_MARGIN_S))
    # only these flags, whatever the caller's: the device count and the suite's compile flags
    devs = f"--xla_force_host_platform_device_count={devices} {COLLECTIVE_FLAGS}" if devices else ""
    env["XLA_FLAGS"] = with_test_flags(devs)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), HERE, env.get("PYTHONPATH", "")])
    return env


class _Stuck(Exception):
    """A run that timed out, or that XLA or faulthandler reported stuck: worth one more try."""


def _check(what, returncode, stderr):
    """Raise _Stuck for a stuck run, AssertionError for any other failure; pass on success."""
    if returncode == 0:
        return
    if any(m in stderr for m in STUCK_MARKERS):
        raise _Stuck(f"got stuck ({returncode}):\n{stderr[-3000:]}")
    raise AssertionError(f"{what} failed ({returncode}):\n{stderr[-4000:]}")


def _timed_out(timeout, err) -> _Stuck:
    err = err.decode(errors="replace") if isinstance(err, bytes) else (err or "")
    return _Stuck(f"timed out after {timeout} s:\n{err[-2000:]}")


def _twice(what, attempt):
    """attempt() once more if it got stuck (sharding_scripts/common.py: COLLECTIVE_FLAGS)."""
    for n in (1, 2):
        try:
            return attempt()
        except _Stuck as e:
            if n == 2:
                raise AssertionError(f"{what}: {e} (twice)") from None
            warnings.warn(f"{what}: {e}; running it once more")


def _json_lines(out):
    return [json.loads(l) for l in out.splitlines() if l.startswith("{")]


def _run_cmd(what, cmd, devices, timeout=ATTEMPT_TIMEOUT_S, cwd=SCRIPTS) -> str:
    """Run `cmd` in its own process with `devices` forced CPU devices; returns its stdout. A run
    that got stuck is run once more."""

    def attempt():
        try:
            p = subprocess.run(cmd, cwd=cwd, env=_env(devices, timeout), capture_output=True,
                               text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise _timed_out(timeout, e.stderr) from None
        _check(what, p.returncode, p.stderr)
        return p.stdout

    return _twice(what, attempt)


def _run(script, *args, devices=8, timeout=ATTEMPT_TIMEOUT_S):
    """Run a helper script in its own process; returns its JSON lines (see _run_cmd)."""
    cmd = [sys.executable, os.path.join(SCRIPTS, script), "--devices", str(devices), *args]
    return _json_lines(_run_cmd(f"{script} {' '.join(args)}", cmd, devices, timeout))


# ----------------------------------------------------------------------------- in-process
def test_run_retries_a_stuck_collective_once_and_nothing_else(tmp_path):
    with pytest.warns(UserWarning, match="got stuck"):
        assert _run("stuck_once.py", "--marker", str(tmp_path / "a"), devices=1) == [{"calls": 2}]
    with pytest.raises(AssertionError, match="a real bug"):
        _run("stuck_once.py", "--marker", str(tmp_path / "b"), "--other", devices=1)
    assert (tmp_path / "b").read_text() == "1"  # not run again


def test_run_retries_a_hung_script_after_its_stack_dump(tmp_path):
    """A script that hangs prints its stacks (faulthandler, MASKAHEAD_DUMP_AFTER_S) and exits
    before _run's timeout; _run reports where it hung and runs it once more."""
    with pytest.warns(UserWarning, match="(?s)got stuck.*stuck_once.py.*in main"):
        assert _run("stuck_once.py", "--marker", str(tmp_path / "a"), "--hang", devices=1,
                    timeout=DUMP_MARGIN_S + 4) == [{"calls": 2}]


def test_parse_mesh():
    assert shd.parse_mesh("data=2,model=4") == {"data": 2, "seq": 1, "model": 4}
    assert shd.parse_mesh("model=2, seq=4") == {"data": 1, "seq": 4, "model": 2}
    assert shd.parse_mesh({"data": 8}) == {"data": 8, "seq": 1, "model": 1}
    assert shd.parse_mesh("") == {"data": 1, "seq": 1, "model": 1}
    n = jax.device_count()
    assert shd.parse_mesh("data=-1") == {"data": n, "seq": 1, "model": 1}
    for bad in ("data=2,data=2", "tensor=2", "data=0", "data", "data=-1,model=-1"):
        with pytest.raises(ValueError):
            shd.parse_mesh(bad)


def test_make_mesh_axis_types_and_device_errors():
    mesh = shd.make_mesh("data=1")
    assert mesh.axis_names == shd.MESH_AXES
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
        shd.make_mesh(f"data={jax.device_count() + 1}")


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_param_specs_cover_param_shapes(family):
    cfg = tiny_model(family, num_heads=8, num_kv_heads=4).config
    mesh = shd.abstract_mesh("data=2,model=4")
    specs = shd.param_specs(cfg, mesh)
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)
    s_paths = {jax.tree_util.keystr(k) for k, _ in
               jax.tree_util.tree_flatten_with_path(param_shapes(cfg), is_leaf=is_shape)[0]}
    p_paths = {jax.tree_util.keystr(k) for k, _ in
               jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]}
    assert s_paths == p_paths
    stack = specs.get("layers") or specs["moe_layers"]
    assert stack["wq"] == P(None, None, "model") and stack["wk"] == P(None, None, "model")
    assert stack["wo"] == P(None, "model")
    assert specs["embed"] == P()
    if "moe_layers" in specs:
        ex = specs["moe_layers"]["moe"]["experts"]
        assert ex["gate"] == P(None, "model") and ex["down"] == P(None, "model")  # expert parallel
        assert specs["moe_layers"]["moe"]["shared"]["gate"] == P(None, None, "model")
    if "layers" in specs:
        assert specs["layers"]["mlp"]["gate"] == P(None, None, "model")
        assert specs["layers"]["mlp"]["down"] == P(None, "model")
    # specs read off a params pytree's leaf shapes agree with the config-derived ones
    assert shd.params_specs_like(tiny_model(family, num_heads=8, num_kv_heads=4).params, mesh) == specs


def test_divisibility_fallback_and_axis_reuse():
    mesh = shd.abstract_mesh("data=2,model=4")
    # 6 heads do not split over model=4 -> replicated; batch 3 over data=2 -> replicated
    assert shd.logical_to_spec(("layers", "embed", "heads", "head_dim"), (2, 32, 6, 8), mesh) == P()
    assert shd.cache_spec((2, 3, 4, 64, 8), mesh) == P(None, None, "model")
    assert shd.cache_spec((2, 4, 4, 64, 8), mesh) == P(None, "data", "model")
    # a mesh axis is used once per array: experts win over expert_mlp if both map to model
    rules = dict(shd.RULES, expert_mlp="model")
    assert shd.logical_to_spec(("layers", "experts", "embed", "expert_mlp"), (1, 8, 32, 16), mesh,
                               rules) == P(None, "model")
    # tiny default family: kv heads 2 do not split over model=4, heads 4 do
    cfg = tiny_model("sdar").config
    specs = shd.param_specs(cfg, mesh)
    assert specs["layers"]["wk"] == P() and specs["layers"]["wq"] == P(None, None, "model")
    seq = shd.abstract_mesh("seq=4")
    assert shd.cache_spec((2, 1, 2, 64, 8), seq) == P(None, None, None, "seq")
    assert shd.cache_spec((2, 1, 2, 66, 8), seq) == P()


def test_constrain_cache_is_a_noop_without_mesh():
    c = kvc.empty(2, 2, 2, 16, 8, jnp.float32)
    assert shd.constrain_cache(c) is c
    out = jax.jit(shd.constrain_cache)(c)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: bool((a == b).all()), c, out))


def test_kv_bytes_per_device_scales_with_seq_shards():
    cfg = tiny_model("sdar", num_heads=8, num_kv_heads=4).config
    base = shd.kv_bytes_per_device(cfg, 2, 1024, shd.abstract_mesh("data=1"), jnp.bfloat16)
    for n in (2, 4, 8):
        r = shd.kv_bytes_per_device(cfg, 2, 1024, shd.abstract_mesh(f"seq={n}"), jnp.bfloat16)
        assert r["global"] == base["global"] == base["per_device"]
        assert r["per_device"] * n == base["per_device"]
    r = shd.kv_bytes_per_device(cfg, 2, 1024, shd.abstract_mesh("data=2,model=4"), jnp.bfloat16)
    assert r["per_device"] * 8 == base["per_device"]


def test_single_device_mesh_generate_equals_plain():
    from maskahead_jax.config import GenerationConfig
    from maskahead_jax.generate import generate

    m = tiny_model("fast_dllm_v2")
    gc = GenerationConfig(max_new_tokens=8, prefill_chunk=16, stop_at_eos=False)
    ps = [[1, 2, 3, 4, 5], [7, 8, 9]]
    assert generate(m, ps, gc, mesh="data=1").tokens == generate(m, ps, gc).tokens


def test_shard_params_places_leaves():
    m = tiny_model("llada2", num_heads=8, num_kv_heads=4)
    mesh = shd.make_mesh("data=1")
    host = jax.tree_util.tree_map(np.asarray, m.params)
    placed = shd.shard_params(host, mesh, m.config)
    want = shd.param_shardings(m.config, mesh)
    for a, s, h in zip(jax.tree_util.tree_leaves(placed), jax.tree_util.tree_leaves(want),
                       jax.tree_util.tree_leaves(host)):
        assert a.sharding.is_equivalent_to(s, a.ndim)
        np.testing.assert_array_equal(np.asarray(a), h)


# ----------------------------------------------------------------------------- 8 CPU devices
def _check_parity(recs):
    """Every row equals the unsharded run's tokens, except rows the unsharded run itself changes
    under a few ulps of parameter noise (parity.py's float_sensitive_rows: no exact answer exists
    there); at least one row of each run must be compared exactly."""
    ran = [r for r in recs if "skipped" not in r]
    bad = []
    for r in ran:
        loose = set(r.get("float_sensitive_rows", []))
        differ = {i for i, (a, b) in enumerate(zip(r["ref"], r["out"])) if a != b}
        if differ - loose or len(loose) == len(r["ref"]) or len(r["ref"]) != len(r["out"]):
            bad.append((r["family"], r["policy"], sorted(differ), sorted(loose), r["ref"], r["out"]))
    assert not bad, f"sharded tokens differ from unsharded (rows, float-sensitive rows): {bad}"
    return ran, [r for r in recs if "skipped" in r]


def test_check_parity_excuses_only_float_sensitive_rows():
    rec = dict(family="sdar", policy="q-maskahead", ref=[[1, 2], [3, 4], [5, 6]], equal=False)
    _check_parity([dict(rec, out=[[1, 2], [3, 9], [5, 6]], float_sensitive_rows=[1])])
    with pytest.raises(AssertionError, match="differ"):  # row 0 is float-stable and differs
        _check_parity([dict(rec, out=[[7, 2], [3, 9], [5, 6]], float_sensitive_rows=[1])])
    with pytest.raises(AssertionError, match="differ"):  # no control run: every row must match
        _check_parity([dict(rec, out=[[1, 2], [3, 9], [5, 6]])])
    with pytest.raises(AssertionError, match="differ"):  # nothing left to compare exactly
        _check_parity([dict(rec, out=[[1, 2], [3, 9], [5, 6]], float_sensitive_rows=[0, 1, 2])])


def test_mp_dense_data2_model4_matches_unsharded_every_family():
    recs = _run("parity.py", "--mesh", "data=2,model=4", "--families", ",".join(ALL_FAMILIES),
                "--policies", "dense", "--new", "16")
    ran, _ = _check_parity(recs)
    assert {r["family"] for r in ran} == set(ALL_FAMILIES)
    assert all(r["devices"] == 8 for r in ran)


@pytest.mark.parametrize("policy", ["maskahead", "q-maskahead"])
def test_mp_policies_data2_model4_match_unsharded(policy):
    """One family: a policy reads and writes the cache alone, whose layout is the same for every
    family; each family's own sharded weights (llada2's experts, fused QKV) are the dense test's.
    (Both sdar and llada2 ran here until CI neared its 20-minute budget: ~80 s each.)"""
    q = policy == "q-maskahead"  # whole 32-token key groups: longer prompts, 32-token blocks
    recs = _run("parity.py", "--mesh", "data=2,model=4", "--families", "sdar",
                "--policies", policy, "--new", "64" if q else "24",
                "--lens", "150,90,120,60" if q else "70,45,33,20", "--chunk", "64" if q else "32")
    ran, skipped = _check_parity(recs)
    if skipped and not ran:
        pytest.skip(f"policy {policy!r} unavailable: {skipped[0]['skipped']}")
    assert all(r["evictions"] >= 1 and r["evictions"] == r["ref_evictions"] for r in ran), ran


def test_mp_kernels_under_a_mesh_match_the_reference():
    """kernels/sharded.py: the Pallas kernels (interpret mode) per shard under data / model / seq
    meshes equal the unsharded jnp reference, outputs and statistics; a float context split over
    seq merges its devices' softmax states (the program holds the all_gather), a packed one or a
    max-pooled statistic keeps the sequence whole per device."""
    recs = _run("kernels_check.py", "--meshes", "data=2,model=4;data=2,seq=4", "--impls", "pallas_triton")
    assert len(recs) == 6 and all(r["shard_map"] for r in recs)
    assert all(max(r["out"], r["mass"], r["score"]) < 1e-5 for r in recs), recs
    split = {(r["mesh"], r["kind"], r["pool"]) for r in recs if r["all_gather"]}
    assert split == {("data=2,seq=4", "float", "mean")}


@pytest.mark.parametrize("mesh,policies", [("data=2,model=4", "dense,maskahead,q-maskahead"),
                                           ("data=2,seq=4", "dense,maskahead")])
def test_mp_generate_with_kernels_under_a_mesh_matches_unsharded(mesh, policies):
    """generate(attention="pallas_triton", interpret) under a mesh: the same tokens as the unsharded
    run of the same kernels (itself equal to the reference: tests/test_attention_impl.py)."""
    for pol in policies.split(","):
        q = pol == "q-maskahead"
        recs = _run("parity.py", "--mesh", mesh, "--families", "sdar", "--policies", pol,
                    "--attention", "pallas_triton", "--new", "64" if q else "16", "--steps", "8" if q else "4",
                    "--lens", "150,90,120,60" if q else ("300,190" if "seq" in mesh else "70,45,33,20"),
                    "--chunk", "64")
        ran, _ = _check_parity(recs)
        assert len(ran) == 1 and ran[0]["attention"] == "pallas_triton"


def test_mp_seq_sharded_long_prompt_matches_unsharded():
    recs = _run("parity.py", "--mesh", "data=2,seq=4", "--families", "sdar,llada2,llada",
                "--policies", "dense", "--lens", "300,190", "--chunk", "64", "--new", "16")
    ran, _ = _check_parity(recs)
    assert len(ran) == 3


def test_mp_seq_sharding_lowers_per_device_kv_memory():
    recs = _run("kv_memory.py", "--meshes", "seq=1;seq=4", "--prompt", "1024")
    one, four = recs
    assert four["planned_kv_per_device"] * 4 == one["planned_kv_per_device"]
    # the compiled core's per-device temp memory (which holds the cache) shrinks too
    assert four["temp_bytes"] < one["temp_bytes"]


def test_mp_profile_cli_reports_per_device_kv_under_seq_sharding():
    """`maskahead profile --mesh seq=4` runs sharded and reports a 4x smaller per-device KV."""
    out = _run_cmd("maskahead profile --mesh seq=4",
                   [sys.executable, "-m", "maskahead_jax.cli", "profile", "--mesh", "seq=4",
                    "--prompt-len", "128", "--out-len", "64", "--batch", "1", "--policies", "dense",
                    "--kv-budget-gb", "1", "--json"], devices=4, cwd=os.path.dirname(HERE))
    (run,) = json.loads(out)["runs"]
    assert run["kv_shards"] == 4.0
    assert run["kv_peak_bytes_per_device"] * 4 == run["kv_peak_bytes"]


@pytest.mark.parametrize("family,mesh", [("sdar", "data=2,model=4"), ("llada2", "data=2,model=4"),
                                         ("llada", "data=2,model=4"), ("sdar", "data=2,seq=4"),
                                         ("llada2", "data=2,seq=4")])
def test_mp_decode_step_hlo_has_no_kv_cache_all_gather(family, mesh):
    (r,) = _run("hlo_check.py", "--family", family, "--mesh", mesh)
    want = P(None, "data", "model") if "model" in mesh else P(None, "data", None, "seq")
    assert r["k_spec"] == str(want)
    assert r["local_k"] * 8 == r["global_k"]
    assert r["cache_sized_gathers"] == [], r
    if family != "llada2" and "model" in mesh:  # Megatron pattern: two all-reduces per layer only
        assert r["all_gathers"] == []


def test_mp_hlo_detector_flags_a_forced_cache_all_gather():
    (r,) = _run("hlo_check.py", "--family", "sdar", "--control")
    assert r["cache_sized_gathers"], r


# ----------------------------------------------------------------------------- 2 processes
def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_mp_two_process_distributed_generate_matches_one_process():
    import jax._src.config as jcfg

    if not hasattr(jcfg, "cpu_collectives_implementation"):
        pytest.skip("this jax has no jax_cpu_collectives_implementation (no CPU cross-process collectives)")
    what = "dist_worker.py x 2 processes"

    def attempt():
        port, procs, logs = _free_port(), [], []
        try:
            for i in range(2):
                env = _env(4)
                env.update(MASKAHEAD_COORDINATOR=f"localhost:{port}", MASKAHEAD_NUM_PROCESSES="2",
                           MASKAHEAD_PROCESS_ID=str(i), MASKAHEAD_CPU_COLLECTIVES="gloo")
                logs.append((tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")))
                # output to files, not pipes: a worker blocked on a full pipe would stall the other
                procs.append(subprocess.Popen(
                    [sys.executable, os.path.join(SCRIPTS, "dist_worker.py"), "--devices", "4",
                     "--mesh", "data=2,model=4"], cwd=SCRIPTS, env=env, stdout=logs[i][0],
                    stderr=logs[i][1], text=True))
            deadline = time.monotonic() + ATTEMPT_TIMEOUT_S
            outs = []
            for p, (out, err) in zip(procs, logs):
                try:
                    p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    err.seek(0)
                    raise _timed_out(ATTEMPT_TIMEOUT_S, err.read()) from None
                out.seek(0), err.seek(0)
                text = err.read()
                if p.returncode != 0 and "gloo" in text.lower() and "not" in text.lower() \
                        and "support" in text.lower():
                    pytest.skip(f"CPU collectives unavailable: {text[-500:]}")
                _check(what, p.returncode, text)
                outs.append(_json_lines(out.read())[-1])
            return outs
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for out, err in logs:
                out.close(), err.close()

    outs = _twice(what, attempt)
    (single,) = _run("dist_worker.py", "--single", devices=1)
    assert [o["processes"] for o in outs] == [2, 2] and {o["process"] for o in outs} == {0, 1}
    assert all(o["devices"] == 8 and o["local_devices"] == 4 for o in outs)
    assert outs[0]["tokens"] == outs[1]["tokens"] == single["tokens"]


def test_mp_load_model_straight_into_shards_hf_and_orbax(tmp_path):
    import importlib.util

    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        pytest.skip("the tiny HF fixture needs torch and transformers")
    recs = _run("load_check.py", "--mesh", "data=4,model=2", "--tmp", str(tmp_path))
    assert {r["source"] for r in recs} == {"hf", "orbax"}
    for r in recs:
        assert r["shardings_ok"] and r["values_equal"], r
        assert r["sharded_leaves"] > 0 and r["max_bytes_per_device"] < r["full_bytes"], r


def test_mp_seq_sharded_top_k_and_compaction_are_exact_and_move_no_slot_axis():
    (r,) = _run("seq_ops_check.py", "--mesh", "data=2,seq=4")
    assert all(v for k, v in r.items() if k.endswith("_equal")), r
    assert r["keep_top_slot_collectives"] == [], r  # two-stage top-k + psum gather: K-sized only
    assert r["plain_slot_collectives"], r  # control: GSPMD's plain top_k gathers the slot axis


def test_mp_seq_sharded_maskahead_matches_unsharded():
    recs = _run("parity.py", "--mesh", "data=2,seq=4", "--families", "sdar", "--policies", "maskahead",
                "--lens", "300,190", "--chunk", "64", "--new", "24")
    ran, skipped = _check_parity(recs)
    if skipped and not ran:
        pytest.skip(f"maskahead unavailable: {skipped[0]['skipped']}")
    assert all(r["evictions"] >= 1 for r in ran), ran
