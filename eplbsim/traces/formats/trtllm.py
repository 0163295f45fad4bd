"""Import TensorRT-LLM expert statistics (`EXPERT_STATISTIC_ITER_RANGE`) as a counts-only trace.

Dimensions: `S` iterations (steps), `L` MoE layers, `P` slots counted per layer.

TensorRT-LLM's PyTorch backend counts, for every iteration in `EXPERT_STATISTIC_ITER_RANGE` and
every MoE layer, how many routed (token, choice) pairs went to each slot, and writes them to
`EXPERT_STATISTIC_PATH` (`tensorrt_llm/_torch/expert_statistic.py` at NVIDIA/TensorRT-LLM
0fccc5b97dd7b23c438e740b3bf4dcde607266c4; the MoE modules call it with their `num_slots`):

- `meta_info.json` (written by rank 0): `{"num_experts": P, "num_experts_per_token": K}`;
- `rank{r}.safetensors`, one per rank: a tensor named `"{iter}_{layer}"` per (iteration, model
  layer index), the `torch.bincount` of that rank's routed slot ids, int64 `[P]`.

The safetensors files are parsed here without the `safetensors` package (an 8-byte
little-endian header length, a JSON header mapping each name to its `dtype`, `shape` and
`data_offsets`, then the raw little-endian bytes); only integer tensors are accepted and nothing
is unpickled. Other files in the directory (TensorRT-LLM also writes e.g.
`rank{r}_raw.safetensors` or `cooccurrence_rank{r}.safetensors`) are ignored.

The ranks' counts are summed, as TensorRT-LLM's own reader does
(`examples/wide_ep/ep_load_balancer/utils.py` at b35ac1b64368513d215c57d2ed01d62d910df8da):
with attention data parallelism each rank counts its own tokens, so the sum is the whole
iteration's. Without it every rank sees every token and the sum counts each pair once per rank;
`rank=r` then reads rank `r`'s file alone. Iterations become steps in ascending order (their ids
in `meta["iterations"]`) and layers are the layer ids present, ascending (`meta["model_layers"]`);
every (iteration, layer) must appear in some rank's file.

The columns are what TensorRT-LLM counted: **slots**. Without a load balancer (`moe_config`'s
`load_balancer` unset) slot `j` is logical expert `j` and `P = E`. With one, a slot is a
physical replica, and neither the dump nor `meta_info.json` says which expert it holds (the
balancer's `initial_global_assignments` do, and online balancing moves them), so the counts are
returned per slot, unmapped: `meta["counted"]` is `"slots"`.

Anything corrupt, partial or inconsistent is an InputError naming the file and the tensor.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from ...base.errors import InputError
from ...base.files import regular_file
from ...base.limits import MAX_EXPERTS, MAX_LOAD, MAX_TOP_K
from ..counts import CountsTrace

META = "meta_info.json"
_RANK_FILE = re.compile(r"rank(\d+)\.safetensors")
_KEY = re.compile(r"(\d+)_(\d+)")
_INT_DTYPES = {"I8": "<i1", "I16": "<i2", "I32": "<i4", "I64": "<i8",
               "U8": "<u1", "U16": "<u2", "U32": "<u4", "U64": "<u8"}
_MAX_HEADER = 100_000_000  # bytes: safetensors' own cap on the JSON header


def is_trtllm_stats(path: Path) -> bool:
    """Whether `path` is a directory holding `meta_info.json` and a `rank{r}.safetensors`."""
    return path.is_dir() and (path / META).is_file() and any(
        _RANK_FILE.fullmatch(p.name) for p in path.iterdir())


def read_trtllm_stats(path: Path, *, rank: int | None = None) -> CountsTrace:
    """TensorRT-LLM's expert statistic directory (module doc) as a CountsTrace `[S, L, P]`:
    every rank's counts summed, or rank `rank`'s alone."""
    path = Path(path)
    P, K = _meta(path / META)
    files = {int(m.group(1)): p for p in path.iterdir() if (m := _RANK_FILE.fullmatch(p.name))}
    if not files:
        raise InputError(f"{path}: no rank{{r}}.safetensors files")
    if rank is not None:
        if rank not in files:
            raise InputError(f"{path}: no rank{rank}.safetensors; the ranks are "
                             f"{sorted(files)}")
        files = {rank: files[rank]}
    totals: dict[tuple[int, int], np.ndarray] = {}
    for r in sorted(files):
        for key, counts in _rank_counts(files[r], P).items():
            totals[key] = totals[key] + counts if key in totals else counts
    iterations = sorted({i for i, _ in totals})
    layers = sorted({layer for _, layer in totals})
    missing = [(i, layer) for i in iterations for layer in layers if (i, layer) not in totals]
    if missing:
        i, layer = missing[0]
        raise InputError(f"{path}: no rank file counts layer {layer} in iteration {i} (tensor "
                         f"{i}_{layer}), though other iterations count it")
    counts = np.stack([np.stack([totals[i, layer] for layer in layers]) for i in iterations])
    meta = {"source": "trtllm", "format": "expert statistic", "directory": str(path),
            "ranks": sorted(files), "iterations": iterations, "model_layers": layers,
            "num_experts_per_token": K, "counted": "slots"}
    try:
        return CountsTrace(counts, meta)
    except InputError as exc:
        raise InputError(f"{path}: {exc}") from None


def _meta(path: Path) -> tuple[int, int]:
    """`(num_experts, num_experts_per_token)` of `meta_info.json`."""
    try:
        with open(regular_file(path, "TensorRT-LLM meta_info.json"), encoding="utf-8") as f:
            meta = json.load(f)
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except (ValueError, RecursionError) as exc:
        raise InputError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise InputError(f"{path}: expected an object with num_experts and "
                         f"num_experts_per_token, got {type(meta).__name__} (rank 0 counted "
                         f"nothing?)")
    values = []
    for key, cap in (("num_experts", MAX_EXPERTS), ("num_experts_per_token", MAX_TOP_K)):
        v = meta.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= cap:
            raise InputError(f"{path}: {key} must be an integer in [1, {cap}], got {v!r}")
        values.append(v)
    return values[0], values[1]


def _rank_counts(path: Path, P: int) -> dict[tuple[int, int], np.ndarray]:
    """`{(iteration, layer): int64 [P]}` of one rank's file."""
    out = {}
    for name, arr in read_safetensors(path).items():
        m = _KEY.fullmatch(name)
        if m is None:
            raise InputError(f"{path}: tensor {name!r} is not named \"{{iter}}_{{layer}}\"")
        if arr.shape != (P,):
            raise InputError(f"{path}: tensor {name} has shape {list(arr.shape)}, but "
                             f"{META} gives {P} slots")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) > MAX_LOAD):
            raise InputError(f"{path}: tensor {name} has counts outside [0, 2**53]")
        out[int(m.group(1)), int(m.group(2))] = arr.astype(np.int64)
    if not out:
        raise InputError(f"{path}: holds no tensors")
    return out


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The integer tensors of a safetensors file, parsed with numpy (module doc); InputError
    naming the file and tensor for anything else."""
    try:
        with open(regular_file(path, "safetensors file"), "rb") as f:
            data = f.read()
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if len(data) < 8:
        raise InputError(f"{path}: truncated ({len(data)} bytes; a safetensors file starts "
                         f"with an 8-byte header length)")
    size = int.from_bytes(data[:8], "little")
    if size > min(len(data) - 8, _MAX_HEADER):
        raise InputError(f"{path}: header length {size} exceeds the file's "
                         f"{len(data) - 8} bytes after it (truncated, or not safetensors)")
    try:
        header = json.loads(data[8:8 + size].decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise InputError(f"{path}: header is not UTF-8 JSON ({exc})") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: header must be a JSON object")
    body = memoryview(data)[8 + size:]
    return {name: _tensor(path, name, info, body) for name, info in header.items()
            if name != "__metadata__"}


def _tensor(path: Path, name: str, info: Any, body: memoryview) -> np.ndarray:
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise InputError(f"{where}: its header entry must be an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _INT_DTYPES:
        raise InputError(f"{where}: dtype {dtype!r}; counts must be integers "
                         f"({', '.join(_INT_DTYPES)})")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool)
                                              and d >= 0 for d in shape):
        raise InputError(f"{where}: shape must be a list of non-negative integers, "
                         f"got {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= len(body)):
        raise InputError(f"{where}: data_offsets {offsets!r} do not lie within the "
                         f"{len(body)} data bytes")
    dt = np.dtype(_INT_DTYPES[dtype])
    count = math.prod(shape)
    if offsets[1] - offsets[0] != count * dt.itemsize:
        raise InputError(f"{where}: data_offsets span {offsets[1] - offsets[0]} bytes, but "
                         f"{dtype} {shape} needs {count * dt.itemsize}")
    return np.frombuffer(body, dt, count, offsets[0]).reshape(shape)
