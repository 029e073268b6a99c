"""PyTorch / HF checkpoints <-> maskahead_jax params (per-family key maps), orbax I/O;
HF `config.json` -> ModelConfig (`model_config_from_hf`).

Converters sit above the library: they import maskahead_jax, which never imports them at module
level (only `load_pretrained` and `maskahead convert` do, when called)."""
from .export import export_hf_state_dict, save_hf
from .hf_config import model_config_from_file, model_config_from_hf
from .keymaps import LAYOUTS, build_plan
from .load import (cli_convert, convert, is_converted, load_hf_params, load_model, read_config,
                   restore_orbax, save_orbax)
from .tensors import CheckpointError, open_tensors

__all__ = ["CheckpointError", "LAYOUTS", "build_plan", "cli_convert", "convert", "export_hf_state_dict",
           "is_converted", "load_hf_params", "load_model", "model_config_from_file", "model_config_from_hf",
           "open_tensors", "read_config", "restore_orbax", "save_hf", "save_orbax"]
