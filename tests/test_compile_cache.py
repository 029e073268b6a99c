"""compile_cache.relieve drops JAX's compiled programs, and with them LLVM's memory mappings,
once the process holds more than a fraction of vm.max_map_count (a long sweep or test worker
otherwise dies inside XLA's compile)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from maskahead_jax import compile_cache


@pytest.mark.skipif(compile_cache.mapped_regions() is None or compile_cache.max_map_count() is None,
                    reason="needs Linux /proc")
def test_relieve_releases_the_mappings_of_compiled_programs():
    compile_cache.relieve(0.0)  # start from empty caches
    before = compile_cache.mapped_regions()
    fns = [jax.jit(lambda x, k=k: jnp.sin(x) * k + jnp.cumsum(x)) for k in range(20)]
    for f in fns:
        f(jnp.ones((64,))).block_until_ready()
    grown = compile_cache.mapped_regions()
    assert grown > before + 20  # each compiled program holds mappings of its own
    assert not compile_cache.relieve(1.0)  # under the limit: nothing dropped
    assert compile_cache.relieve(0.0)  # over (any fraction of it): caches cleared
    assert compile_cache.mapped_regions() < grown - 20
    assert float(fns[0](jnp.ones((64,)))[0]) == pytest.approx(float(jnp.sin(1.0) * 0 + 1.0))  # recompiles
