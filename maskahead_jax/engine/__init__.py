"""The generation engine: host side (generate.py), typed loop state (state.py), prefill, one
block step (block.py), the block-causal and bidirectional cores, stats, and the uncached
reference decoder (reference.py). The engine calls policy hooks (policies/protocol.py) and
knows no policy's fields.
"""
from .generate import PromptTooLongError, generate, prompt_bucket
from .stats import GenerateOutput

__all__ = ["BudgetWarning", "GenerateOutput", "PromptTooLongError", "generate", "prompt_bucket"]
