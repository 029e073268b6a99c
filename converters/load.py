"""HF folder / converted orbax folder -> `Model`; `convert` and the `maskahead convert` CLI.

A converted folder holds `config.json` (and the tokenizer files) copied from the source,
`params/` (an orbax StandardCheckpointer save of the params pytree) and `maskahead.json`
(format marker + stored dtype).

A model can also be named by its Hugging Face hub id ("Efficient-Large-Model/Fast_dLLM_v2_7B"):
`resolve_model_path` finds it in the Hugging Face cache (downloading its weights, config and
tokenizer files when the hub is reachable) and returns the snapshot folder. A local path that
exists always wins over a hub id; no code from the repository is ever downloaded or run.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from maskahead_jax.config import FAMILY_DEFAULTS, ConfigError, ModelConfig
from maskahead_jax.model import param_shapes
from maskahead_jax.model.container import Model
from maskahead_jax.model.rope import with_rope

from .hf_config import checkpoint_keys, model_config_from_hf
from .keymaps import IGNORED, build_plan, convert_tensor
from .tensors import CheckpointError, nonfinite_count, open_tensors, weight_files

MARKER = "maskahead.json"
PARAMS_DIR = "params"
FORMAT = "maskahead-orbax"


# ------------------------------------------------------------------ Hugging Face hub ids

# "org/name" (huggingface_hub's repo-id rules: letters, digits, "-", "_", "."; no "--" or "..";
# no leading / trailing "-" or "."). Single names ("gpt2") are not taken as hub ids: a typo'd
# local folder name would otherwise be looked up on the hub.
_HUB_PART = r"[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"^{_HUB_PART}/{_HUB_PART}$")
# what is fetched from a hub repository: config, tokenizer and chat template files and the
# safetensors weights (torch .bin weights only when the repository has no safetensors); never code
HUB_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja", "tokenizer*")
HUB_BIN_PATTERNS = ("pytorch_model*.bin",)


class HubError(CheckpointError):
    """A hub id that cannot be resolved: not cached and the hub unreachable / offline, unknown, gated."""


def is_hub_id(name: str) -> bool:
    """Whether `name` has the form of a Hugging Face hub id, "org/name"."""
    return bool(_HUB_ID.match(str(name))) and "--" not in name and ".." not in name


def hub_cache_dir() -> str:
    """The Hugging Face hub cache, read from the environment when called (as huggingface_hub
    reads it at import): HF_HUB_CACHE, else HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        home = env.get("HF_HOME") or os.path.join(
            env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
        cache = os.path.join(os.path.expanduser(home), "hub")
    return os.path.expanduser(cache)


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set to 1 / true / yes / on."""
    v = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return v.strip().upper() in {"1", "ON", "YES", "TRUE"}


def _how_to_get(repo_id: str, cache: str) -> str:
    return (f"run `hf download {repo_id}` (huggingface_hub < 1.0: `huggingface-cli download {repo_id}`) "
            f"on a machine with network and copy {os.path.join(cache, 'models--' + repo_id.replace('/', '--'))} "
            f"here, or pass a local folder")


def hub_snapshot(repo_id: str, cache_dir: Optional[str] = None, offline: Optional[bool] = None,
                 quiet: bool = False) -> str:
    """The local snapshot folder of hub model `repo_id` (its main revision), through the Hugging
    Face cache: downloaded (config, tokenizer and weight files; `HUB_PATTERNS`) when the hub is
    reachable, the cached snapshot when it is not or when HF_HUB_OFFLINE is set. HubError, one
    line saying how to get the model, when neither works."""
    import huggingface_hub as hub
    from huggingface_hub import errors as hub_errors

    cache = cache_dir or hub_cache_dir()
    offline = hub_offline() if offline is None else offline

    def fetch(patterns, local_only):
        return hub.snapshot_download(repo_id, cache_dir=cache, local_files_only=local_only,
                                     allow_patterns=list(patterns))

    cached = isinstance(hub.try_to_load_from_cache(repo_id, "config.json", cache_dir=cache), str)
    if not offline and not cached and not quiet:
        print(f"maskahead: downloading {repo_id} from the Hugging Face hub into {cache} "
              f"(config, tokenizer and safetensors weights)", file=sys.stderr, flush=True)
    try:
        path = fetch(HUB_PATTERNS, offline)
        if not offline and not any(f.endswith(".safetensors") for f in os.listdir(path)):
            path = fetch(HUB_PATTERNS + HUB_BIN_PATTERNS, False)  # an old repository: torch weights
    except hub_errors.GatedRepoError:
        raise HubError(f"model '{repo_id}' is gated on the Hugging Face hub: accept its terms at "
                       f"https://huggingface.co/{repo_id} and log in (`hf auth login` or HF_TOKEN)") from None
    except hub_errors.RepositoryNotFoundError:
        raise HubError(f"no local folder {repo_id}, and no model '{repo_id}' on the Hugging Face hub (a "
                       f"private one needs `hf auth login` or HF_TOKEN)") from None
    except hub_errors.IncompleteSnapshotError:
        why = "HF_HUB_OFFLINE is set" if offline else "the hub is unreachable"
        raise HubError(f"the cached snapshot of model '{repo_id}' in {cache} is incomplete and {why}: "
                       f"{_how_to_get(repo_id, cache)}") from None
    except (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled):
        why = "the hub is offline (HF_HUB_OFFLINE is set)" if offline else "the hub is unreachable"
        raise HubError(f"model '{repo_id}' is not in the Hugging Face cache ({cache}) and {why}: "
                       f"{_how_to_get(repo_id, cache)}") from None
    except Exception as e:  # the connection lost mid-download, the hub answering 5xx, ...
        if isinstance(e, OSError) and not isinstance(e, (hub_errors.HfHubHTTPError, ConnectionError)):
            raise  # a local I/O error, e.g. a full disk: as it is
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise HubError(f"downloading model '{repo_id}' into {cache} failed ({type(e).__name__}: {first}); "
                       f"rerun to resume the download, or {_how_to_get(repo_id, cache)}") from e
    return path


def resolve_model_path(name: str, quiet: bool = False) -> str:
    """A model folder for `name`: `name` itself when it exists (a local path always wins), else,
    when `name` is a Hugging Face hub id ("org/name"), its snapshot folder in the Hugging Face
    cache (`hub_snapshot`: downloaded when the hub is reachable, offline from the cache; HF_HOME,
    HF_HUB_CACHE and HF_HUB_OFFLINE are respected). FileNotFoundError for a missing local path,
    HubError for a hub id that cannot be had."""
    name = os.fspath(name)
    if os.path.exists(name):
        return name
    if not is_hub_id(name):
        raise FileNotFoundError(f"no such checkpoint folder: {name}")
    try:
        return hub_snapshot(name, quiet=quiet)
    except HubError as e:  # say the local folder is missing too: "org/name" may be a typo'd path
        msg = str(e)
        if "no local folder" in msg:
            raise
        org, rest = name.split("/", 1)
        where = f": {org} exists but holds no {rest}" if os.path.isdir(org) else ""
        raise HubError(f"{msg} (no local folder {name} either{where})") from None


def _np_dtype(dtype) -> Optional[np.dtype]:
    """The numpy dtype of a `dtype=` argument; anything but a float dtype is a ConfigError."""
    if dtype is None:
        return None
    try:
        dt = np.dtype(jnp.dtype(dtype))
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        raise ConfigError(f"dtype={dtype!r} is not a floating-point dtype; use float32, bfloat16 or float16")
    return dt


def read_config(path: str, family: Optional[str] = None) -> ModelConfig:
    """The ModelConfig of an HF or converted folder, with errors that name the folder.

    family: force the model family (see `model_config_from_hf`); a converted folder defaults to
    the family it was converted as. A hub id is resolved first (`resolve_model_path`)."""
    path = resolve_model_path(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no such checkpoint folder: {path}")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise CheckpointError(f"{path} has no config.json (expected an HF model folder or a folder "
                              "written by `maskahead convert`)")
    if family is None and is_converted(path):
        family = _read_json(os.path.join(path, MARKER)).get("family")
    hf = _read_json(cfg_path)
    try:
        return model_config_from_hf(hf, family=family, keys=lambda: checkpoint_keys(path))
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{cfg_path}: {e}") from e


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def _first(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" (+{len(names) - n} more)" if len(names) > n else "")


def load_hf_params(path: str, cfg: ModelConfig, dtype=None, progress: bool = False,
                   shardings=None) -> dict:
    """Read, validate and convert an HF checkpoint folder into the params pytree.

    Every expected key must be present with the expected shape and no unknown key may be
    left over; this is checked from the file headers before any tensor data is read. Tensors
    are then streamed one at a time into preallocated host buffers and moved to the device
    leaf by leaf, so peak host memory stays near one copy of the model.
    dtype=None keeps the checkpoint's storage dtype (that of the embedding).
    shardings: optional NamedSharding pytree (`maskahead_jax.sharding.param_shardings`): each
    leaf then goes straight into its shards (every device receives only its slice).
    """
    tensors = open_tensors(path)
    plan, optional = build_plan(cfg)
    missing = [k for k in plan if k not in tensors]
    if missing:
        detail = [f"{k} (expected shape {plan[k].hf_shape})" for k in missing]
        raise CheckpointError(f"missing key(s) for {cfg.family} ({cfg.layout} layout) in {path}: "
                              f"{_first(detail)}")
    extra = sorted(k for k in tensors if k not in plan and k not in optional and not IGNORED.match(k))
    if extra:
        raise CheckpointError(f"unexpected key(s) in {path}, not part of the {cfg.layout} layout for "
                              f"this config: {_first(extra)}")
    for k, e in plan.items():
        if tensors[k].shape != e.hf_shape:
            raise CheckpointError(f"wrong shape for {k} in {tensors[k].file}: expected {e.hf_shape}, "
                                  f"found {tensors[k].shape}")
        _check_float(k, tensors[k].file, tensors[k].dtype)
    embed_key = next(k for k, e in plan.items() if e.slots[0].path == ("embed",))
    dt = _np_dtype(dtype)
    if dt is None:
        dt = tensors[embed_key].load().dtype
    if not jnp.issubdtype(dt, jnp.floating):
        dt = np.dtype(np.float32)

    shapes = param_shapes(cfg)
    bufs: dict[tuple[str, ...], np.ndarray] = {}
    for kp, shp in jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))[0]:
        bufs[tuple(p.key for p in kp)] = np.empty(shp, dt)
    order = sorted(plan, key=lambda k: (tensors[k].file, k))
    for k in tqdm(order, desc=f"converting {os.path.basename(os.path.normpath(path))}",
                  disable=not progress, unit="tensor"):
        e = plan[k]
        x = tensors[k].load()
        _check_float(k, tensors[k].file, x.dtype)
        bad = nonfinite_count(x)
        if bad:
            raise CheckpointError(f"tensor {k} in {tensors[k].file} has {bad} non-finite value(s) (NaN / inf)")
        for slot, arr in zip(e.slots, convert_tensor(e, x)):
            bufs[slot.path][slot.index] = arr

    def to_device(tree, prefix=()):
        out = {}
        for name, sub in tree.items():
            p = prefix + (name,)
            if isinstance(sub, dict):
                out[name] = to_device(sub, p)
            elif shardings is not None:
                out[name] = _put_sharded(bufs.pop(p), _at(shardings, p))
            else:
                out[name] = jnp.asarray(bufs.pop(p))
        return out

    return to_device(shapes)


def _check_float(key: str, file: str, dtype) -> None:
    """A weight stored as integers or booleans (a quantized checkpoint, a wrong export) is refused:
    casting it to float would load other numbers than the model's."""
    if dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
        raise CheckpointError(f"tensor {key} in {file} is stored as {np.dtype(dtype).name}, not a float dtype: "
                              "quantized / integer weights are not supported (they would be cast, not dequantized)")


def _at(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _put_sharded(buf: np.ndarray, sharding):
    from maskahead_jax.sharding import _put

    return _put(buf, sharding)


def _mesh_shardings(cfg: ModelConfig, mesh):
    if mesh is None:
        return None
    from maskahead_jax import sharding as shd

    return shd.param_shardings(cfg, shd.make_mesh(mesh) if isinstance(mesh, (str, dict)) else mesh)


# ------------------------------------------------------------------ orbax


def is_converted(path: str) -> bool:
    return os.path.exists(os.path.join(path, MARKER))


def save_orbax(params: Any, path: str) -> None:
    """Save the params pytree to `path` (an orbax StandardCheckpointer directory)."""
    import orbax.checkpoint as ocp

    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.abspath(path), params)
    ckptr.wait_until_finished()


def restore_orbax(path: str, cfg: ModelConfig, dtype, shardings=None) -> dict:
    """Restore a params pytree saved by `save_orbax`, stored as `dtype`.

    shardings: optional NamedSharding pytree (`maskahead_jax.sharding.param_shardings`): orbax
    then reads every leaf straight into its shards (no full copy on one device).
    """
    import orbax.checkpoint as ocp

    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)
    if shardings is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree_util.tree_map(lambda s: one, param_shapes(cfg), is_leaf=is_shape)
    target = jax.tree_util.tree_map(lambda s, sh: jax.ShapeDtypeStruct(s, dtype, sharding=sh),
                                    param_shapes(cfg), shardings, is_leaf=is_shape)
    try:
        return ocp.StandardCheckpointer().restore(os.path.abspath(path), target)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise CheckpointError(f"cannot restore converted params from {path}: {e}") from e


def load_model(path: str, dtype=None, progress: bool = False, mesh=None,
               family: Optional[str] = None, rope_theta: Optional[float] = None, rope_scaling=None,
               max_position_embeddings: Optional[int] = None) -> Model:
    """Load an HF folder (safetensors / torch .bin) or a folder written by `convert`.

    family: force the model family (`model_config_from_hf`), e.g. to run a Qwen2 folder without
    a block-diffusion marker as fast_dllm_v2.

    rope_theta / rope_scaling / max_position_embeddings: RoPE knobs applied over config.json
    (`maskahead_jax.model.rope.with_rope`; checked before any weight is read).

    mesh: optional jax Mesh or spec ("data=2,model=4"): params are loaded straight into their
    shards by the rules of `maskahead_jax.sharding` (orbax restores sharded; HF tensors are put
    leaf by leaf from host buffers).

    path: a local folder, or a Hugging Face hub id ("org/name") resolved through the Hugging
    Face cache (`resolve_model_path`; a local path that exists wins).
    """
    _np_dtype(dtype)  # a non-float dtype is refused before anything is read
    path = resolve_model_path(path)
    cfg = with_rope(read_config(path, family), rope_theta, rope_scaling, max_position_embeddings)
    shardings = _mesh_shardings(cfg, mesh)
    if is_converted(path):
        with open(os.path.join(path, MARKER)) as f:
            stored = np.dtype(jnp.dtype(json.load(f)["dtype"]))
        params = restore_orbax(os.path.join(path, PARAMS_DIR), cfg, stored, shardings)
        model = Model(cfg, params)
        dt = _np_dtype(dtype)
        return model if dt is None or dt == stored else model.astype(dt)
    return Model(cfg, load_hf_params(path, cfg, dtype=dtype, progress=progress, shardings=shardings))


def written_by_convert(path: str) -> bool:
    """Whether folder `path` holds the marker `convert` writes (maskahead.json of FORMAT)."""
    try:
        with open(os.path.join(path, MARKER), encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("format") == FORMAT


def _check_paths(src: str, dst: str) -> None:
    """Refuse a destination that is the source, lies inside it, or holds it."""
    s, d = os.path.realpath(src), os.path.realpath(dst)
    if s == d:
        raise CheckpointError(f"destination {dst} is the source folder {src}; convert into another folder")
    if os.path.commonpath([s, d]) == s:
        raise CheckpointError(f"destination {dst} lies inside the source folder {src}")
    if os.path.commonpath([s, d]) == d:
        raise CheckpointError(f"source {src} lies inside the destination folder {dst}")
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise CheckpointError(f"destination {dst} is a file, not a folder")


def _write_converted(model: Model, src: str, out: str) -> None:
    """Write `model` and the non-weight files of `src` into the (empty) folder `out`."""
    skip = {os.path.basename(f) for f in weight_files(src)} | {
        "model.safetensors.index.json", "pytorch_model.bin.index.json", MARKER}
    for name in os.listdir(src):
        full = os.path.join(src, name)
        if os.path.isfile(full) and name not in skip:
            shutil.copy2(full, os.path.join(out, name))
    save_orbax(model.params, os.path.join(out, PARAMS_DIR))
    leaf = jax.tree_util.tree_leaves(model.params)[0]
    with open(os.path.join(out, MARKER), "w") as f:
        json.dump({"format": FORMAT, "version": 1, "dtype": str(leaf.dtype),
                   "family": model.config.family, "layout": model.config.layout}, f, indent=1)


def convert(src: str, dst: str, dtype=None, progress: bool = True, overwrite: bool = False,
            family: Optional[str] = None) -> str:
    """Convert `src` (HF or converted folder) into an orbax folder at `dst`; returns `dst`.

    The non-weight files of `src` (config.json, tokenizer, generation config) are copied along.
    `src` is read and validated in full before `dst` is touched; the result is written to a
    hidden sibling folder and renamed into place, so a failure leaves `dst` as it was.
    family: force the model family (recorded in maskahead.json, used when `dst` is loaded).
    `src` may be a Hugging Face hub id (`resolve_model_path`).
    """
    src = resolve_model_path(src)
    _check_paths(src, dst)
    if os.path.isdir(dst) and os.listdir(dst):
        if not overwrite:
            raise CheckpointError(f"destination {dst} exists and is not empty (use overwrite / --force)")
        if not written_by_convert(dst):  # --force replaces only what convert wrote
            raise CheckpointError(f"destination {dst} is not a folder `maskahead convert` wrote (no {MARKER} "
                                  f"of format {FORMAT}): --force replaces only such a folder or an empty "
                                  f"one; choose another destination")
    model = load_model(src, dtype=dtype, progress=progress, family=family)
    parent, name = os.path.split(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    old = tmp.replace(".tmp-", ".old-")
    try:
        _write_converted(model, src, tmp)
        if os.path.exists(dst):
            os.rename(dst, old)
        try:
            os.rename(tmp, dst)
        except BaseException:
            if os.path.exists(old):
                os.rename(old, dst)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.islink(old):
        os.unlink(old)
    else:
        shutil.rmtree(old, ignore_errors=True)
    return dst


def cli_convert(argv: Optional[Sequence[str]] = None) -> int:
    """`maskahead convert SRC DST [--dtype bfloat16] [--force]`; returns the exit status."""
    ap = argparse.ArgumentParser(prog="maskahead convert",
                                 description="Convert an HF checkpoint folder to a maskahead orbax folder.",
                                 epilog="exit status: 0 converted; 1 an I/O error while writing (DST is left as it "
                                        "was); 2 bad input (options, SRC, DST), one line on stderr; 130 interrupted")
    ap.add_argument("src", help="HF folder (config.json + *.safetensors or pytorch_model*.bin), or a Hugging "
                                "Face hub id (org/name, through the HF cache)")
    ap.add_argument("dst", help="output folder")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="parameter dtype (default: the checkpoint's)")
    ap.add_argument("--force", action="store_true",
                    help="replace a non-empty DST that `maskahead convert` wrote (it holds maskahead.json); "
                         "only once SRC has converted. Any other non-empty folder is refused")
    ap.add_argument("--family", default=None, choices=sorted(FAMILY_DEFAULTS),
                    help="force the model family (default: from config.json; a plain autoregressive "
                         "qwen2 / qwen3 config is refused without it)")
    args = ap.parse_args(argv)
    try:
        out = convert(args.src, args.dst, dtype=args.dtype, overwrite=args.force, family=args.family)
    except (CheckpointError, FileNotFoundError, ValueError) as e:  # ConfigError too: bad input, exit 2
        print(f"maskahead convert: error: {(str(e).strip().splitlines() or [type(e).__name__])[0]}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. a full disk while writing: DST is left as it was
        print(f"maskahead convert: error: {e}", file=sys.stderr)
        return 1
    print(f"converted {args.src} -> {out}")
    return 0
