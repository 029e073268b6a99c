"""Evaluation harness: datasets (testbed suite, needle grids, LongBench v1, GSM8K / MATH-500),
model presets, policy construction, policy x budget sweeps with resumable JSONL results,
summary tables, paired sign tests and plots.  See docs/evaluation.md."""
from .datasets import (LONGBENCH_MAXLEN, LONGBENCH_NO_CHAT, LONGBENCH_PROMPTS, EvalExample,
                       Tokenizer, load_tokenizer, longbench_examples, load_longbench, load_math,
                       middle_truncate, needle_grid, score_example, testbed_suite)
from .policies import PolicyError, make_policy, parse_capacities, policy_budgets
from .presets import PRESETS, preset_config
from .stats import paired_sign_test, sign_test
from .sweep import RunFailed, RunMismatch, SweepResult, load_rows, run_fingerprint, run_sweep, summarize, write_summary
