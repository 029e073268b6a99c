"""The tokenizer of a model folder (`load_tokenizer`) behind one small interface (`Tokenizer`:
encode, decode, chat template), whether transformers or `tokenizers` reads it; no code from the
folder is ever run."""
from __future__ import annotations

import json
import os
import warnings
from typing import Optional, Sequence


class Tokenizer:
    """A thin wrapper over a `tokenizers.Tokenizer` or a transformers tokenizer.

    chat_template / special_tokens: a `tokenizers.Tokenizer` has no chat template of its own;
    one read from tokenizer_config.json is rendered here (sandboxed jinja2, as transformers does)."""

    def __init__(self, tok, hf: bool = False, name: str = "", chat_template: Optional[str] = None,
                 special_tokens: Optional[dict] = None):
        self.tok, self.hf, self.name = tok, hf, name
        self.chat_template, self.special_tokens = chat_template, dict(special_tokens or {})

    @property
    def has_chat_template(self) -> bool:
        if self.hf:
            return bool(getattr(self.tok, "chat_template", None))
        return bool(self.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list:
        if self.hf:
            return list(self.tok(text, add_special_tokens=add_special_tokens)["input_ids"])
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        if self.hf:
            return self.tok.decode(ids, skip_special_tokens=True)
        return self.tok.decode(ids)

    def chat(self, text: str) -> str:
        """The user message wrapped by the chat template (with the generation prompt)."""
        import jinja2

        messages = [{"role": "user", "content": text}]
        try:
            if self.hf:
                return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return _render_chat(self.chat_template, messages, **self.special_tokens)
        except (jinja2.TemplateError, ValueError, TypeError) as e:  # syntax, raise_exception, the sandbox
            what = {"TemplateSyntaxError": "has a syntax error", "SecurityError": "does something the sandbox "
                    "forbids"}.get(type(e).__name__, "failed")
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            line = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
            raise ValueError(f"the chat template of {self.name or 'the tokenizer'} {what}{line}: {first}") from None

    def encode_prompt(self, text: str, chat: bool = True) -> list:
        if chat and self.has_chat_template:
            # the template carries its own special tokens
            return self.encode(self.chat(text), add_special_tokens=False)
        return self.encode(text)


def _render_chat(template: str, messages: list, **special_tokens) -> str:
    """Render a chat template in jinja2's sandbox with transformers' settings and helpers."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, **special_tokens)


_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token")


def _tokenizers_fallback(model_dir: str, config: dict, why: str) -> Tokenizer:
    """tokenizer.json through `tokenizers` (no checkpoint code), keeping the config's chat template."""
    from ..tasks import get_tokenizer

    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(path):
        raise ValueError(f"cannot load the tokenizer of {model_dir}: {why}, and there is no "
                         "tokenizer.json to read instead")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    special = {k: v.get("content") if isinstance(v, dict) else v for k, v in config.items()
               if k in _SPECIAL_TOKENS}
    tok = get_tokenizer(os.path.abspath(path))  # an unreadable tokenizer.json: its one-line error, no warning
    warnings.warn(f"{model_dir}: {why}; loaded tokenizer.json with the `tokenizers` library instead "
                  f"({'with' if template else 'without'} the chat template of tokenizer_config.json)",
                  stacklevel=3)
    return Tokenizer(tok, name=path, chat_template=template, special_tokens=special)


def load_tokenizer(model_dir: Optional[str] = None) -> Tokenizer:
    """The tokenizer of a model folder: transformers (chat template) when tokenizer_config.json
    is there, else tokenizer.json through `tokenizers`, else the testbed tokenizer.

    No code from the folder is ever run: transformers is called with trust_remote_code=False, and
    a folder whose tokenizer_config.json names a custom class (`auto_map`), or that transformers
    cannot load, is read from tokenizer.json with `tokenizers` (chat template kept), with a warning.
    """
    from ..tasks import get_tokenizer

    if model_dir and not os.path.isdir(model_dir):
        from converters.load import resolve_model_path  # a hub id: its cached snapshot folder

        model_dir = resolve_model_path(model_dir, quiet=True)
    if model_dir and os.path.isdir(model_dir):
        config_path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.exists(config_path):
            try:
                with open(config_path, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, ValueError) as e:
                raise ValueError(f"cannot read {config_path}: {e}") from None
            if not isinstance(config, dict):
                raise ValueError(f"{config_path} is not a JSON object")
            if "auto_map" in config:
                return _tokenizers_fallback(model_dir, config, "tokenizer_config.json names a custom "
                                            "tokenizer class (auto_map), whose code is not run")
            try:
                from transformers import AutoTokenizer
                from transformers.utils import logging as hf_logging

                was = hf_logging.get_verbosity()
                hf_logging.set_verbosity_error()  # its notes on the model type are not ours to print
                try:
                    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, trust_remote_code=False)
                finally:
                    hf_logging.set_verbosity(was)
            except Exception as e:
                first = (str(e).splitlines() or [""])[0]
                return _tokenizers_fallback(model_dir, config,
                                            f"transformers cannot load it ({type(e).__name__}: {first})")
            return Tokenizer(tok, hf=True, name=model_dir)
        path = os.path.join(model_dir, "tokenizer.json")
        if os.path.exists(path):
            return Tokenizer(get_tokenizer(os.path.abspath(path)), name=path)
        warnings.warn(f"{model_dir} holds no tokenizer (tokenizer.json / tokenizer_config.json): "
                      f"using the testbed tokenizer", stacklevel=2)
    return Tokenizer(get_tokenizer(), name="testbed")
