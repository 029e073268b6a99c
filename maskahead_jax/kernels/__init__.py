"""Attention ops: jnp references and Pallas kernels behind one dispatch."""
from . import reference
