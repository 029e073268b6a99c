"""docs/extending.md's worked example, run exactly as the doc shows it: the policy file is the
doc's first code block, registered through MASKAHEAD_POLICY_PLUGINS and run by `maskahead eval`."""
from __future__ import annotations

import json
import os
import re
import sys

import jax.numpy as jnp
import numpy as np

from maskahead_jax import cli
from maskahead_jax.policies import make, names, registry

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "extending.md")


def _blocks(lang):
    with open(DOC) as f:
        return re.findall(rf"```{lang}\n(.*?)```", f.read(), re.S)


def test_keynorm_example_registers_runs_and_keeps_the_largest_keys(tmp_path, monkeypatch, capsys):
    (tmp_path / "keynorm.py").write_text(_blocks("python")[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(registry.PLUGINS_ENV, "keynorm")
    monkeypatch.setattr(registry, "_loaded", set())
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.delitem(sys.modules, "keynorm", raising=False)
    assert "keynorm" in names()
    pol = make("keynorm", 10)
    assert type(pol).__name__ == "KeyNorm" and pol.capacity_pct == 10.0
    assert pol.stats_request(jnp.ones((1, 4), bool), jnp.ones((1,), bool)) is None  # no statistics

    # its scorer ranks by key norm: the largest keys survive besides the forced ones
    from maskahead_jax.cache import empty

    n = 40
    k = np.zeros((1, 1, 1, n, 2), np.float32)
    k[0, 0, 0, :, 0] = np.random.RandomState(0).rand(n)
    c = empty(1, 1, 1, n, 2, jnp.float32).append(jnp.asarray(k), jnp.asarray(k),
                                                 jnp.arange(n, dtype=jnp.int32)[None], jnp.asarray([n]))
    out = pol.eviction.evict(c, None, None, jnp.asarray([4 + 32 + 2]), n)
    kept = np.asarray(out.pos)[0, 0, 0][np.asarray(out.valid)[0, 0, 0]].tolist()
    middle = sorted(set(range(4, n - 32)), key=lambda i: -k[0, 0, 0, i, 0])[:2]
    assert kept == sorted(set(range(4)) | set(range(n - 32, n)) | set(middle))

    # the doc's command line, at a tiny size
    cmd = _blocks("bash")[0].split()
    assert cmd[:3] == ["MASKAHEAD_POLICY_PLUGINS=keynorm", "maskahead", "eval"]
    args = cmd[2:]
    args[args.index("--lengths") + 1] = "128"
    args[args.index("--out") + 1] = str(tmp_path / "ev")
    args += ["--depths", "0.5", "--n", "1", "--no-progress", "--policy-kw", "capacity_floor=40"]
    assert cli.main(args) == 0
    rows = [json.loads(line) for line in open(tmp_path / "ev" / "results.jsonl")]
    assert sorted(r["policy"] for r in rows) == ["dense", "keynorm"]
    (kn,) = [r for r in rows if r["policy"] == "keynorm"]
    assert kn["capacity"] == 10.0 and kn["reduction_final"] > 1.0  # it evicted


def test_tova_example_probes_the_newest_stored_token(tmp_path, monkeypatch):
    """docs/extending.md's second file: its probe forwards, at every eviction, the newest stored
    token at its own position (the prompt's last stored token first, then the last committed
    one), and the policy evicts to its budget through generate."""
    import dataclasses

    import jax

    from maskahead_jax import GenerationConfig, generate
    from tiny import tiny_model

    (tmp_path / "tova.py").write_text(_blocks("python")[2])
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.delitem(sys.modules, "tova", raising=False)
    import tova

    assert type(make("tova", 10)).__name__ == "Tova"
    seen = []

    @dataclasses.dataclass(frozen=True)
    class Spy(tova.NewestQuery):
        def mass(self, cache, ctx):
            pos = jnp.maximum((ctx.n_pre if ctx.start is None else ctx.start) - 1, 0)
            jax.debug.callback(lambda p, g: seen.append((np.asarray(p), np.asarray(g))), pos, ctx.generated)
            return super().mass(cache, ctx)

    @dataclasses.dataclass(frozen=True)
    class SpyTova(tova.Tova):
        @property
        def eviction(self):
            ev = super().eviction
            return dataclasses.replace(ev, schedule=dataclasses.replace(ev.schedule, probe=Spy()))

    m = tiny_model("sdar", num_layers=2)
    rng = np.random.RandomState(0)
    prompts = [list(map(int, rng.randint(2, 40, size=n))) for n in (100, 70)]
    gc = GenerationConfig(max_new_tokens=16, block_size=8, prefill_chunk=32, stop_at_eos=False)
    out = generate(m, prompts, gc, policy=SpyTova(capacity_pct=20, capacity_floor=8))
    assert out.stats["evictions"] >= 2 and min(out.stats["reduction_final"]) > 1.0
    n_pre = [len(p) // 8 * 8 for p in prompts]
    seen.sort(key=lambda s: int(s[0].sum()))  # evictions in order: positions only grow
    assert [int(x) for x in seen[0][0]] == [n - 1 for n in n_pre]  # the first: the prompt's last stored token
    for pos, gen in seen[1:]:  # later: a committed token, the one generate returned at that position
        for row, p in enumerate(pos):
            assert p >= n_pre[row]
            full = prompts[row] + list(out.tokens[row])
            assert int(gen[row][p - n_pre[row]]) == full[p]
