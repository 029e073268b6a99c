"""RoPE as a checkpoint's config says: plain, or one of the scaled types of Hugging Face configs.

`RopeScaling` is the hashable record of a `rope_scaling` / `rope_parameters` entry (stored on
`ModelConfig.rope_scaling`; None = plain RoPE). `rope_frequencies.frequencies` turns it into the
inverse frequencies [rot_dim / 2] and the attention factor that multiplies cos and sin, computed
the way transformers' `modeling_rope_utils.py` computes them for each type (float32 where it uses
float32). `scaling_from_hf` reads a config dict; `parse_scaling` reads the user knob
("yarn:4", a dict, or a RopeScaling); `with_rope` applies the knobs to a ModelConfig.

Types: linear (positions / factor), dynamic (NTK base grown with the sequence length), yarn
(frequency-wise interpolation + attention temperature), llama3 (Llama 3.1's wavelength bands),
longrope (per-frequency factors, short / long by sequence length), and one of ours that no
transformers config carries: dynamic_yarn (YaRN with the factor the sequence needs: length /
original, between 1 and `factor`; the YaRN paper's "Dynamic-YaRN", arXiv 2309.00071 §3.4), so a
model runs plain RoPE up to its trained length and YaRN x(T / original) beyond. A user knob at
load time (`rope_scaling="dynamic_yarn:16:2048"`), or from an export's `maskahead_rope_scaling`
(`hf_fields`: transformers, which ignores that key, runs such an export with plain RoPE).

Sequence-length dependent types (dynamic, longrope, dynamic_yarn) read `seq_len`: 0 = the forward's own length
(its largest position + 1, as transformers' forward does); > 0 = that fixed length. The cached
engine fixes it to the run's total length (`for_run`), so every chunk of a run uses one base.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Union

from ..config import ConfigError, ModelConfig

ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3", "longrope", "dynamic_yarn")
_YARNS = ("yarn", "dynamic_yarn")
OWN_KEY = "maskahead_rope_scaling"  # config.json key of a scaling transformers has no type for
_PLAIN = (None, "default", "none")
# fields a type cannot do without (what transformers' validation requires, less those it defaults)
_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",), "dynamic_yarn": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
             "longrope": ("short_factor", "long_factor")}
# string knob defaults for llama3 (the values of Llama 3.1's release)
_LLAMA3_LOW, _LLAMA3_HIGH = 1.0, 4.0


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """One scaled-RoPE setting (hashable: part of the static ModelConfig).

    type: linear | dynamic | yarn | llama3 | longrope | dynamic_yarn.
    factor: the length multiplier (longrope: only sets the default attention factor; dynamic_yarn:
        the largest one it applies).
    original_max_position_embeddings: the length the model was trained at (dynamic: the config's
        max_position_embeddings, as transformers reads it).
    beta_fast / beta_slow, mscale / mscale_all_dim, truncate: YaRN's ramp and temperature.
    attention_factor: multiplies cos and sin (yarn / longrope); None = the type's default.
    low_freq_factor / high_freq_factor: llama3's wavelength bands.
    short_factor / long_factor: longrope's per-frequency divisors [rot_dim / 2].
    seq_len: dynamic / longrope / dynamic_yarn: 0 = each forward's own length; > 0 = fixed at it.
    """

    type: str
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None
    truncate: bool = True
    low_freq_factor: float = _LLAMA3_LOW
    high_freq_factor: float = _LLAMA3_HIGH
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    seq_len: int = 0

    def __post_init__(self):
        if self.type not in ROPE_TYPES:
            raise ConfigError(f"rope_scaling type {self.type!r} is not supported; supported: "
                              f"{', '.join(ROPE_TYPES)} (or default / none for plain RoPE)")
        bad = lambda what: ConfigError(f"rope_scaling ({self.type}): {what}")
        if not _finite(self.factor) or self.factor <= 0 or (self.type != "longrope" and self.factor < 1):
            raise bad(f"factor must be a number >= 1, got {self.factor!r}")
        if self.type != "linear" and not (isinstance(self.original_max_position_embeddings, int)
                                          and self.original_max_position_embeddings > 0):
            raise bad("original_max_position_embeddings must be a positive integer, got "
                      f"{self.original_max_position_embeddings!r}")
        for name in ("beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor"):
            if not _finite(getattr(self, name)):
                raise bad(f"{name} must be a finite number, got {getattr(self, name)!r}")
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            v = getattr(self, name)
            if v is not None and (not _finite(v) or v < 0):
                raise bad(f"{name} must be a finite number >= 0, got {v!r}")
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise bad(f"high_freq_factor {self.high_freq_factor} must exceed low_freq_factor {self.low_freq_factor}")
        if self.type == "longrope":
            for name in ("short_factor", "long_factor"):
                v = getattr(self, name)
                if not v or not all(_finite(x) and x > 0 for x in v):
                    raise bad(f"{name} must be a non-empty list of positive numbers")
            if len(self.short_factor) != len(self.long_factor):
                raise bad(f"short_factor has {len(self.short_factor)} entries, long_factor {len(self.long_factor)}")
        if not isinstance(self.seq_len, int) or self.seq_len < 0:
            raise bad(f"seq_len must be an integer >= 0, got {self.seq_len!r}")

    @property
    def length_dependent(self) -> bool:
        """Whether the frequencies depend on the sequence length (dynamic, longrope, dynamic_yarn)."""
        return self.type in ("dynamic", "longrope", "dynamic_yarn")

    @property
    def extended_length(self) -> int:
        """factor x original length: the positions this scaling is made for (0 if unknown)."""
        return int(round(self.factor * self.original_max_position_embeddings))

    def to_hf(self) -> dict[str, Any]:
        """The `rope_scaling` dict of a config.json (what `scaling_from_hf` reads back)."""
        d: dict[str, Any] = {"rope_type": self.type, "factor": self.factor}
        if self.original_max_position_embeddings and self.type != "dynamic":  # dynamic: max_position_embeddings
            d["original_max_position_embeddings"] = self.original_max_position_embeddings
        if self.type in _YARNS:
            d.update(beta_fast=self.beta_fast, beta_slow=self.beta_slow, truncate=self.truncate)
            d.update({k: getattr(self, k) for k in ("mscale", "mscale_all_dim")
                      if getattr(self, k) is not None})
        if self.type in _YARNS + ("longrope",) and self.attention_factor is not None:
            d["attention_factor"] = self.attention_factor
        if self.type == "llama3":
            d.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor)
        if self.type == "longrope":
            d.update(short_factor=list(self.short_factor), long_factor=list(self.long_factor))
        return d


def hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json fields that carry cfg's RoPE scaling (none for plain RoPE): `rope_scaling`,
    and for dynamic NTK `max_position_embeddings` = its original length (what transformers reads).
    dynamic_yarn, which no transformers config can name, goes under `maskahead_rope_scaling`
    (OWN_KEY), read before `rope_scaling` by this library's loader and ignored by transformers."""
    s = cfg.rope_scaling
    if s is None:
        return {}
    if s.type == "dynamic_yarn":  # no transformers type: our own key; transformers reads plain RoPE,
        return {OWN_KEY: s.to_hf()}  # which dynamic_yarn equals up to the original length
    out: dict[str, Any] = {"rope_scaling": s.to_hf()}
    if s.type == "dynamic":
        out["max_position_embeddings"] = s.original_max_position_embeddings
    return out


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# ------------------------------------------------------------------ reading configs and knobs


def _number(d: dict, key: str, where: str, default=None, kind=float):
    v = d.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(f"{where}: {key} must be a finite number, got {v!r}")
    if kind is int:
        if v != int(v):
            raise ConfigError(f"{where}: {key} must be an integer, got {v!r}")
        return int(v)
    return float(v)


def scaling_from_hf(d: Optional[dict], max_position_embeddings: int, top_original: Optional[int] = None,
                    where: str = "rope_scaling") -> Optional[RopeScaling]:
    """A RopeScaling from a config's `rope_scaling` / `rope_parameters` dict (None: plain RoPE).

    The type is `rope_type` (else `type`); `default` / absent = plain. max_position_embeddings:
    the config's own (dynamic's original length; yarn / longrope's factor when the dict has none;
    the original length of yarn / llama3 / longrope when the dict has none). top_original: a
    config's top-level `original_max_position_embeddings`, which transformers puts over the
    dict's. An unknown type, a missing required field or a bad value is a ConfigError naming it."""
    if d is None:
        return None
    if not isinstance(d, dict):
        raise ConfigError(f"{where} must be a JSON object or null, got {d!r}")
    kind = d.get("rope_type", d.get("type", "default"))
    if kind in _PLAIN:
        return None
    if kind not in ROPE_TYPES:
        raise ConfigError(f"{where}: rope type {kind!r} is not supported; supported: "
                          f"{', '.join(ROPE_TYPES)} (or default for plain RoPE)")
    where = f"{where} ({kind})"
    missing = [k for k in _REQUIRED[kind] if k not in d]
    if missing:
        raise ConfigError(f"{where} lacks required field(s): {', '.join(missing)}")
    prf = _number(d, "partial_rotary_factor", where)
    if prf is not None and prf != 1.0:
        raise ConfigError(f"{where}: partial_rotary_factor {prf} inside the RoPE parameters is not supported")
    orig = _number(d, "original_max_position_embeddings", where, kind=int)
    if kind == "dynamic":  # transformers reads the config's max_position_embeddings here
        orig = max_position_embeddings
    elif kind != "linear":
        orig = top_original or orig or max_position_embeddings
    orig = int(orig or 0)
    factor = _number(d, "factor", where)
    if factor is None:  # yarn / longrope: implied by the two lengths
        if kind not in _YARNS + ("longrope",):
            raise ConfigError(f"{where}: factor must be a number, got None")
        factor = max_position_embeddings / orig
    kw: dict[str, Any] = dict(type=kind, factor=factor, original_max_position_embeddings=orig)
    if kind in _YARNS:
        kw.update(beta_fast=_number(d, "beta_fast", where) or 32.0, beta_slow=_number(d, "beta_slow", where) or 1.0,
                  mscale=_number(d, "mscale", where), mscale_all_dim=_number(d, "mscale_all_dim", where),
                  attention_factor=_number(d, "attention_factor", where))
        truncate = d.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ConfigError(f"{where}: truncate must be true or false, got {truncate!r}")
        kw["truncate"] = truncate
    elif kind == "llama3":
        kw.update(low_freq_factor=_number(d, "low_freq_factor", where),
                  high_freq_factor=_number(d, "high_freq_factor", where))
    elif kind == "longrope":
        for name in ("short_factor", "long_factor"):
            v = d[name]
            if not isinstance(v, (list, tuple)) or not all(_finite(x) for x in v):
                raise ConfigError(f"{where}: {name} must be a list of numbers, got {v!r}")
            kw[name] = tuple(float(x) for x in v)
        kw["attention_factor"] = _number(d, "attention_factor", where)
    return RopeScaling(**kw)


def parse_scaling(spec: Union[None, str, dict, RopeScaling], original: int) -> Union[None, str, RopeScaling]:
    """The user knob: a RopeScaling, an HF-style dict, or "TYPE:FACTOR[:ORIGINAL]" ("yarn:4",
    "linear:2", "dynamic:2", "llama3:8"). original: the checkpoint's trained length, the default
    original length. "none" / "default" -> "none" (plain RoPE); None -> None (keep the config's)."""
    if spec is None or isinstance(spec, RopeScaling):
        return spec
    if isinstance(spec, dict):
        d = spec if "original_max_position_embeddings" in spec else {**spec, "original_max_position_embeddings": original}
        return scaling_from_hf(d, d["original_max_position_embeddings"] if d.get(
            "rope_type", d.get("type")) == "dynamic" else original) or "none"
    if not isinstance(spec, str):
        raise ConfigError(f"rope_scaling must be a string like 'yarn:4', a dict or None, got {spec!r}")
    parts = [p.strip() for p in spec.strip().split(":")]
    kind = parts[0].lower()
    if kind in ("none", "default") and len(parts) == 1:
        return "none"
    if kind == "longrope":
        raise ConfigError("rope_scaling 'longrope' needs its short_factor / long_factor lists: pass a dict")
    if kind not in ROPE_TYPES or len(parts) not in (2, 3):
        raise ConfigError(f"rope_scaling {spec!r}: expected TYPE:FACTOR[:ORIGINAL_LENGTH] with TYPE one of "
                          f"{', '.join(t for t in ROPE_TYPES if t != 'longrope')} (e.g. yarn:4), or none")
    try:
        factor = float(parts[1])
        orig = int(parts[2]) if len(parts) == 3 else int(original)
    except ValueError:
        raise ConfigError(f"rope_scaling {spec!r}: FACTOR must be a number and ORIGINAL_LENGTH an integer") from None
    return RopeScaling(type=kind, factor=factor, original_max_position_embeddings=orig)


def original_length(cfg: ModelConfig) -> int:
    """The length the checkpoint was trained at: its scaling's original length, else its positions."""
    s = cfg.rope_scaling
    return (s.original_max_position_embeddings if s is not None and s.original_max_position_embeddings
            else cfg.max_position_embeddings)


def with_rope(cfg: ModelConfig, rope_theta: Optional[float] = None, rope_scaling=None,
              max_position_embeddings: Optional[int] = None) -> ModelConfig:
    """cfg with the user's RoPE knobs: rope_theta replaces the base (LongLLaDA's recipe multiplies
    it); rope_scaling (see `parse_scaling`) replaces the config's scaling and raises the positions
    to factor x original length; max_position_embeddings sets the positions outright."""
    kw: dict[str, Any] = {}
    if rope_theta is not None:
        if not _finite(rope_theta) or rope_theta <= 0:
            raise ConfigError(f"rope_theta must be a positive number, got {rope_theta!r}")
        kw["rope_theta"] = float(rope_theta)
    scaling = parse_scaling(rope_scaling, original_length(cfg))
    if scaling == "none":
        kw["rope_scaling"] = None
    elif scaling is not None:
        kw["rope_scaling"] = scaling
        kw["max_position_embeddings"] = max(cfg.max_position_embeddings, scaling.extended_length)
    if max_position_embeddings is not None:
        if isinstance(max_position_embeddings, bool) or not isinstance(max_position_embeddings, int) \
                or max_position_embeddings < 1:
            raise ConfigError(f"max_position_embeddings must be a positive integer, got {max_position_embeddings!r}")
        kw["max_position_embeddings"] = max_position_embeddings
    return cfg.replace(**kw) if kw else cfg


def for_run(cfg: ModelConfig, total_len: int) -> ModelConfig:
    """cfg for one cached run of `total_len` positions: a length-dependent scaling (dynamic,
    longrope) fixed at that length, so every chunk and step of the run uses the same frequencies."""
    s = cfg.rope_scaling
    if s is None or not s.length_dependent or s.seq_len:
        return cfg
    return cfg.replace(rope_scaling=dataclasses.replace(s, seq_len=int(total_len)))
