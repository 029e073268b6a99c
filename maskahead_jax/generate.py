"""`maskahead_jax.generate`: the public entry point, kept where users import it from; the engine
itself lives in maskahead_jax/engine."""
from .engine.generate import BudgetWarning, PromptTooLongError, generate, prompt_bucket
from .engine.stats import GenerateOutput

__all__ = ["BudgetWarning", "GenerateOutput", "PromptTooLongError", "generate", "prompt_bucket"]
