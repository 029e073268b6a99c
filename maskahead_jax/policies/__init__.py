"""KV-cache policies: frozen, hashable dataclasses passed to `generate(..., policy=...)`."""
from .base import Dense
