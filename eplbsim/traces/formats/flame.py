"""Import FLAME-MoE routing traces (parquet, one file per MoE layer) as an eplbsim Trace.

Dimensions: `N` token rows, `S` steps, `L` MoE layers (one file each), `K` top-k, `E` experts.

The FLAME-MoE project (github.com/cmu-flame/FLAME-MoE at
e9b2fe2df3f1abb8dbb9ec0eabde8cdfb65e5c78, `scripts/empirical_analysis/`) captures its router's
choices while it evaluates a pretraining checkpoint, and publishes them as the Hugging Face data
set `CMU-FLAME/FLAME-MoE-Traces`, whose card gives the layout read here:

    flame-moe-290m/
        samples/000.parquet ...                token_id int32, one row per token
        actives/iter_NNNN/layer_NN.parquet     scores list<float16>[6], indices list<int16>[6]

An `actives/iter_NNNN/layer_NN.parquet` row is one token's routing in model layer `NN` at
training iteration `NNNN`: `indices`, its top-k routed expert ids (0-63; the two shared experts
are not logged), and `scores`, their router probabilities (not imported). Row `i` is the same
token in every layer file of an iteration (and in `samples/`, whose token ids a Trace has no
place for). A path may be one layer file (`L = 1`), an iteration directory holding
`layer_NN.parquet` files, or a directory holding `iter_NNNN` directories directly or under
`actives/` (then `iteration` picks one; it may be left out when there is just one).

The rows are token rows of training-style forward passes over fixed-length sequences (the
capture evaluates `--seq-length 2048` sequences, `capture_step2.sh`); nothing groups them into
requests (no request or sample id column), so they are read as a Trace, not a RequestSet: rows
in file order, cut into steps of `step_tokens` rows (default 2048, one sequence a step; the
capture's micro-batch is `MICRO_BATCH_SIZE` sequences, 8 for FLAME-MoE-290M, so 16384 replays
one micro-batch a step), the last step keeping what is left. `max_tokens` reads only the first
rows of each file (a capture holds 52,428,800 tokens). `meta["model_layers"]` is the `NN` of each
layer file and `meta["iteration"]` the `NNNN` when the path names them. `-1` ids are padding.

Reading needs pyarrow (the `dev` extra installs it). A row with a null, a wrong number of ids,
an id out of range or one expert twice is an InputError naming the file and the row.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from ...base.errors import InputError
from ...base.files import check_memory
from ...base.limits import MAX_EXPERTS, MAX_LAYERS, MAX_TOP_K
from ...base.loops import first_duplicate
from ..trace import Trace

SEQ_LENGTH = 2048  # the capture's --seq-length: the default step
_LAYER = re.compile(r"layer_(\d+)\.parquet")
_ITERATION = re.compile(r"iter_(\d+)")
_BATCH_ROWS = 1 << 16


def is_flame(path: Path) -> bool:
    """Whether `path` is a `.parquet` file or a directory of FLAME-MoE layer files (module
    doc)."""
    if path.is_file():
        return path.suffix.lower() == ".parquet"
    return path.is_dir() and (bool(_layer_files(path)) or any(
        _layer_files(d) for d in _iterations(path).values()))


def _layer_files(folder: Path) -> dict[int, Path]:
    """`{model layer: file}` of the `layer_NN.parquet` files in `folder`."""
    return {int(m.group(1)): p for p in folder.iterdir()
            if (m := _LAYER.fullmatch(p.name)) and p.is_file()}


def _iterations(path: Path) -> dict[int, Path]:
    """`{iteration: directory}` of the `iter_NNNN` directories in `path` or `path/actives`."""
    root = path / "actives" if (path / "actives").is_dir() else path
    return {int(m.group(1)): p for p in root.iterdir()
            if (m := _ITERATION.fullmatch(p.name)) and p.is_dir()}


def _resolve(path: Path, iteration: int | None
             ) -> tuple[int | None, list[int | None], list[Path]]:
    """The iteration, model layers and layer files a path names (module doc)."""
    if path.is_dir():
        files = _layer_files(path)
        if not files:
            return _chosen(path, iteration)
        folder, layers, paths = path, sorted(files), [files[k] for k in sorted(files)]
    elif path.is_file():
        m = _LAYER.fullmatch(path.name)
        folder, layers, paths = path.parent, [int(m.group(1)) if m else None], [path]
    else:
        raise InputError(f"{path}: no such file or directory")
    if iteration is not None:
        raise InputError(f"{path}: iteration picks among iter_NNNN directories; this path "
                         f"names its layer files itself")
    m = _ITERATION.fullmatch(folder.name)
    return (int(m.group(1)) if m else None), layers, paths


def _chosen(path: Path, iteration: int | None
            ) -> tuple[int, list[int | None], list[Path]]:
    """`_resolve` for a directory of `iter_NNNN` directories: the one `iteration` names."""
    found = {i: d for i, d in _iterations(path).items() if _layer_files(d)}
    if not found:
        raise InputError(f"{path}: holds no layer_NN.parquet files, nor iter_NNNN directories "
                         f"of them")
    if iteration is None and len(found) > 1:
        raise InputError(f"{path}: holds iterations {sorted(found)}; choose one with "
                         f"iteration")
    chosen = next(iter(found)) if iteration is None else iteration
    if chosen not in found:
        raise InputError(f"{path}: has no iteration {chosen}; it has {sorted(found)}")
    files = _layer_files(found[chosen])
    return chosen, sorted(files), [files[k] for k in sorted(files)]


def read_flame(path: Path, *, experts: int | None = None, step_tokens: int = SEQ_LENGTH,
               iteration: int | None = None, max_tokens: int | None = None) -> Trace:
    """FLAME-MoE routing parquet (module doc) as a Trace of `step_tokens`-row steps;
    `experts` defaults to the largest id + 1."""
    path = Path(path)
    for name, value, least in (("experts", experts, 1), ("step_tokens", step_tokens, 1),
                               ("iteration", iteration, 0), ("max_tokens", max_tokens, 1)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < least):
            raise InputError(f"{name} must be an integer >= {least}, got {value!r}")
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError("reading FLAME-MoE parquet needs pyarrow (pip install pyarrow, or "
                         "the eplbsim[dev] extra)") from None
    iteration, layers, files = _resolve(path, iteration)
    if len(files) > MAX_LAYERS:
        raise InputError(f"{path}: {len(files)} layer files, above the cap of {MAX_LAYERS}")
    opened = [_open(pq, f) for f in files]
    rows = {f: p.metadata.num_rows for f, p in zip(files, opened)}
    if len(set(rows.values())) > 1:
        f, n = next((f, n) for f, n in rows.items() if n != rows[files[0]])
        raise InputError(f"{f}: {n} rows, but {files[0].name} has {rows[files[0]]}; every "
                         f"layer file of an iteration holds the same tokens")
    N = min(rows[files[0]], max_tokens or rows[files[0]])
    if N == 0:
        raise InputError(f"{files[0]}: holds no rows")
    limit = MAX_EXPERTS if experts is None else experts
    first = _read_layer(opened[0], files[0], N, limit)
    K = first.shape[1]
    check_memory(N * len(files) * K * 6, f"reading {path}", "read fewer rows (max_tokens)")
    ids = np.empty((N, len(files), K), dtype=np.int32)  # [N, L, K]
    ids[:, 0] = first
    for layer, (f, p) in enumerate(zip(files[1:], opened[1:]), 1):
        ids[:, layer] = _read_layer(p, f, N, limit, K)
    duplicate = first_duplicate(ids)
    if duplicate is not None:
        row, layer, expert = duplicate
        raise InputError(f"{files[layer]}: row {row} routes expert {expert} twice (a router "
                         f"picks top_k distinct experts)")
    meta: dict[str, Any] = {"source": "flame-moe", "format": "parquet", "path": str(path),
                            "step_tokens": step_tokens, "rows_in_files": rows[files[0]]}
    if iteration is not None:
        meta["iteration"] = iteration
    if all(layer is not None for layer in layers):
        meta["model_layers"] = layers
    E = experts if experts is not None else max(1, int(ids.max()) + 1)
    offsets = np.append(np.arange(0, N, step_tokens), N)
    try:
        return Trace(ids, offsets, E, None, meta)
    except InputError as exc:
        raise InputError(f"{path}: {exc}") from None


def _open(pq: Any, path: Path) -> Any:
    """A `pyarrow.parquet.ParquetFile` with an `indices` column; InputError otherwise."""
    import pyarrow as pa

    try:
        opened = pq.ParquetFile(path)
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise InputError(f"{path}: not a readable parquet file ({exc})") from None
    names = opened.schema_arrow.names
    if "indices" not in names:
        raise InputError(f"{path}: no indices column (a FLAME-MoE layer file has indices and "
                         f"scores); the columns are {', '.join(names) or 'none'}")
    return opened


def _read_layer(opened: Any, path: Path, N: int, limit: int, K: int | None = None
                ) -> np.ndarray:
    """The first `N` rows of a layer file's `indices`, int64 `[N, K]`, checked row by row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    chunks, got = [], 0
    try:
        for batch in opened.iter_batches(batch_size=_BATCH_ROWS, columns=["indices"]):
            chunks.append(batch.column(0))
            got += batch.num_rows
            if got >= N:
                break
        column = pa.concat_arrays(chunks).slice(0, N)
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise InputError(f"{path}: cannot read its indices ({exc})") from None
    kind = column.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)
            or pa.types.is_fixed_size_list(kind)) or not pa.types.is_integer(kind.value_type):
        raise InputError(f"{path}: indices must be lists of integer ids, got {kind}")
    if column.null_count:
        row = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
        raise InputError(f"{path}: row {row}: indices is null")
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    width = int(lengths[0]) if K is None else K
    bad = np.flatnonzero(lengths != width)
    if bad.size or not 1 <= width <= MAX_TOP_K:
        row = int(bad[0]) if bad.size else 0
        raise InputError(f"{path}: row {row}: {int(lengths[row])} indices, expected {width} "
                         f"(the same top-k in every row and layer, in [1, {MAX_TOP_K}])")
    values = column.flatten()
    if values.null_count:
        row = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0]) // width
        raise InputError(f"{path}: row {row}: indices holds a null id")
    raw = values.to_numpy(zero_copy_only=False).reshape(N, width)
    wrong = np.flatnonzero(((raw < -1) | (raw >= limit)).any(1))  # in the file's own dtype
    if wrong.size:
        row = int(wrong[0])
        raise InputError(f"{path}: row {row}: expert ids {raw[row].tolist()} outside "
                         f"[-1, {limit})")
    return raw.astype(np.int64)
