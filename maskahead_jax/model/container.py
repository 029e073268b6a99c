"""`Model`: a ModelConfig plus its params pytree.

Low level on purpose (it needs only jax and the config): the public API (`maskahead_jax.api`,
re-exported as `maskahead_jax.Model`) and the checkpoint converters both import it from here.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax

from ..config import ModelConfig


@dataclasses.dataclass
class Model:
    """A config plus its params pytree."""

    config: ModelConfig
    params: Any

    def astype(self, dtype) -> "Model":
        return Model(self.config, jax.tree_util.tree_map(lambda a: a.astype(dtype), self.params))
