"""Attention masks as predicates of positions, so that no pass has to hold a [T, T] boolean.

A block of T queries reads S keys; which pairs are allowed is a function of the two positions
and of the key's validity (padding):

    bidirectional (block_size 0)   every valid key
    block-causal  (block_size bs)  a valid key whose block (pos // bs) <= the query's block

`PositionMask` carries the positions and the key validity ([B, T] + [B, S], O(T)) and makes the
boolean tile for any range of queries and keys on demand (`tile`), which is what a chunked
attention needs; short passes materialise the whole thing once (`dense`), exactly the mask the
engine used to build.
"""
from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp


@jax.tree_util.register_pytree_node_class
class PositionMask:
    """q_pos [B, T] int32, k_pos [B, S] int32, k_valid [B, S] bool or None; block_size a static
    int (0: bidirectional). Query t may read key s iff `allowed(q_pos[t], k_pos[s])`."""

    def __init__(self, q_pos: jax.Array, k_pos: jax.Array, k_valid: Optional[jax.Array] = None,
                 block_size: int = 0):
        if block_size < 0:
            raise ValueError(f"block_size must be >= 0 (0: bidirectional), got {block_size}")
        self.q_pos, self.k_pos, self.k_valid, self.block_size = q_pos, k_pos, k_valid, int(block_size)

    def tree_flatten(self):
        return (self.q_pos, self.k_pos, self.k_valid), self.block_size

    @classmethod
    def tree_unflatten(cls, block_size, children):
        return cls(*children, block_size=block_size)

    @property
    def shape(self) -> tuple:
        """The shape of the boolean it stands for: (B, T, S)."""
        return self.q_pos.shape + self.k_pos.shape[-1:]

    @staticmethod
    def _pairs(q_pos, k_pos, k_valid, block_size):
        if block_size:
            m = (k_pos[:, None, :] // block_size) <= (q_pos[:, :, None] // block_size)
        else:
            m = jnp.ones(q_pos.shape + k_pos.shape[-1:], bool)
        return m if k_valid is None else m & k_valid[:, None, :]

    def dense(self) -> jax.Array:
        """The whole [B, T, S] boolean (short passes only)."""
        return self._pairs(self.q_pos, self.k_pos, self.k_valid, self.block_size)

    def tile(self, q_pos: jax.Array, k_pos: jax.Array, k_valid: Optional[jax.Array]) -> jax.Array:
        """[B, Tq, Sk] for a chunk of query positions and one of keys (the caller slices)."""
        return self._pairs(q_pos, k_pos, k_valid, self.block_size)


Mask = Union[jax.Array, PositionMask]


def dense(mask: Mask) -> jax.Array:
    """A [B, T, S] boolean, whichever form the mask has."""
    return mask.dense() if isinstance(mask, PositionMask) else mask


def block_causal(positions: jax.Array, block_size: int, key_valid: Optional[jax.Array] = None) -> PositionMask:
    """Self-attention of a sequence at `positions` [B, T], block-causal by absolute position."""
    return PositionMask(positions, positions, key_valid, block_size)


def bidirectional(positions: jax.Array, key_valid: Optional[jax.Array] = None) -> PositionMask:
    """Self-attention of a sequence at `positions` [B, T], every valid key."""
    return PositionMask(positions, positions, key_valid, 0)
