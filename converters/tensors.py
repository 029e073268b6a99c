"""Lazy, streaming access to the tensors of an HF checkpoint folder.

Safetensors files are parsed here directly (8-byte header length, JSON header, raw data) and
memory-mapped, so bfloat16 works without torch and only the tensor being converted is paged
in. Torch `.bin` files are opened with `torch.load(weights_only=True, mmap=True)`.
"""
from __future__ import annotations

import json
import os
import pickle
import struct
from dataclasses import dataclass
from typing import Callable, Optional

import ml_dtypes
import numpy as np


class CheckpointError(ValueError):
    """A checkpoint that does not match what the config says (or cannot be read)."""


_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor lives: its shape, a loader that returns it as a numpy array, and its
    stored dtype as the file header says (None where the format does not say it up front)."""

    file: str
    shape: tuple[int, ...]
    load: Callable[[], np.ndarray]
    dtype: Optional[np.dtype] = None


# bits that are all set in the exponent of an inf / NaN, per float width
_EXP_MASK = {2: None, 4: np.uint32(0x7F800000), 8: np.uint64(0x7FF0000000000000)}


def nonfinite_count(x: np.ndarray, chunk: int = 1 << 24) -> int:
    """How many entries of a float array are inf or NaN, read in chunks (the exponent bits of the
    raw words: no float copy of the tensor is made)."""
    x = np.ascontiguousarray(x).reshape(-1)
    size = x.dtype.itemsize
    if size not in (2, 4, 8):
        return int(np.count_nonzero(~np.isfinite(x.astype(np.float32))))
    if size == 2:  # float16: 5 exponent bits; bfloat16: 8
        mask = np.uint16(0x7C00) if x.dtype == np.float16 else np.uint16(0x7F80)
    else:
        mask = _EXP_MASK[size]
    words = x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[size])
    return sum(int(np.count_nonzero((words[i:i + chunk] & mask) == mask)) for i in range(0, words.size, chunk))


def _safetensors_entries(path: str) -> dict[str, TensorRef]:
    name = os.path.basename(path)
    size = os.path.getsize(path)

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"corrupt safetensors file {name}: {why}")

    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"only {size} bytes, too short for a header")
        (n,) = struct.unpack("<Q", head)
        if n == 0 or 8 + n > size:
            raise bad(f"header length {n} does not fit in a {size}-byte file")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise bad(f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    base, data_len = 8 + n, size - 8 - n
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = np.dtype(_ST_DTYPES[info["dtype"]])
            shape = tuple(int(s) for s in info["shape"])
            start, stop = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"bad header entry for {key!r}: {info!r}") from None
        if not 0 <= start <= stop <= data_len:
            raise bad(f"tensor {key!r} data [{start}, {stop}) lies outside the {data_len} data bytes")
        if stop - start != int(np.prod(shape)) * dtype.itemsize:
            raise bad(f"tensor {key!r}: {stop - start} bytes for shape {shape} {info['dtype']}")

        def load(start=start, stop=stop, dtype=dtype, shape=shape):
            if stop == start:
                return np.zeros(shape, dtype)
            mm = np.memmap(path, dtype=np.uint8, mode="r", offset=base + start, shape=(stop - start,))
            return mm.view(dtype).reshape(shape)

        out[key] = TensorRef(name, shape, load, dtype)
    return out


def _torch_error(name: str, e: Exception) -> CheckpointError:
    """Why a torch file could not be read. torch's weights-only refusal is restated without its
    advice to retry with weights_only=False (unpickling arbitrary objects runs the file's code)."""
    if not (isinstance(e, pickle.UnpicklingError) or "weights_only" in str(e)):
        return CheckpointError(f"cannot read torch checkpoint {name}: {e}")
    why = next((line.strip().rstrip(".") for line in str(e).splitlines() if "unsupported" in line.lower()), "")
    return CheckpointError(f"torch checkpoint {name} holds pickled objects other than tensors"
                           f"{f' ({why})' if why else ''}; they are not loaded, since unpickling them "
                           "could run code from the file. Convert the checkpoint to safetensors "
                           "where you trust it, and load that")


def _torch_entries(path: str) -> dict[str, TensorRef]:
    try:
        import torch
    except ImportError:
        raise CheckpointError(f"{os.path.basename(path)} is a torch .bin file; reading it needs torch "
                              "(pip install torch, CPU build)") from None
    name = os.path.basename(path)
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # legacy (non-zip) files cannot be memory-mapped
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise _torch_error(name, e) from None
    except Exception as e:
        raise _torch_error(name, e) from None
    if not isinstance(sd, dict):
        raise CheckpointError(f"torch checkpoint {name} holds a {type(sd).__name__}, not a state dict")

    def to_numpy(t) -> np.ndarray:
        t = t.detach().contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()

    def np_dtype(t) -> Optional[np.dtype]:
        if t.dtype == torch.bfloat16:
            return np.dtype(ml_dtypes.bfloat16)
        try:
            return np.dtype(str(t.dtype).removeprefix("torch."))
        except TypeError:
            return None

    return {k: TensorRef(name, tuple(v.shape), lambda v=v: to_numpy(v), np_dtype(v)) for k, v in sd.items()}


def _shards(folder: str, index_name: str, pattern_ok: Callable[[str], bool]) -> list[str]:
    index = os.path.join(folder, index_name)
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f).get("weight_map", {}).values()))
        missing = [s for s in files if not os.path.exists(os.path.join(folder, s))]
        if missing:
            raise CheckpointError(f"{index_name} lists shard(s) not in {folder}: {missing}")
        return files
    return sorted(f for f in os.listdir(folder) if pattern_ok(f))


def weight_files(folder: str) -> list[str]:
    """The checkpoint's weight files (safetensors preferred over torch .bin)."""
    st = _shards(folder, "model.safetensors.index.json", lambda f: f.endswith(".safetensors"))
    if st:
        return [os.path.join(folder, f) for f in st]
    pt = _shards(folder, "pytorch_model.bin.index.json",
                 lambda f: f.startswith("pytorch_model") and f.endswith(".bin"))
    return [os.path.join(folder, f) for f in pt]


def open_tensors(folder: str) -> dict[str, TensorRef]:
    """Every tensor of an HF folder by name, without reading any data yet."""
    files = weight_files(folder)
    if not files:
        raise CheckpointError(f"no *.safetensors or pytorch_model*.bin weights in {folder}")
    out: dict[str, TensorRef] = {}
    for path in files:
        entries = _safetensors_entries(path) if path.endswith(".safetensors") else _torch_entries(path)
        for k, ref in entries.items():
            if k in out:
                raise CheckpointError(f"tensor {k!r} appears in both {out[k].file} and {ref.file}")
            out[k] = ref
    return out
