"""`maskahead_jax.generate`: the public entry point, kept where users import it from; the engine
itself lives in maskahead_jax/engine, a drafting policy's first pass in maskahead_jax/drafting.py."""
from .drafting import generate
from .engine.generate import BudgetWarning, PromptTooLongError, prompt_bucket
from .engine.stats import GenerateOutput

__all__ = ["BudgetWarning", "GenerateOutput", "PromptTooLongError", "generate", "prompt_bucket"]
