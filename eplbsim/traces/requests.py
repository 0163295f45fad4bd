"""Requests: routing per request, before an engine batches it into steps (DESIGN.md §9).

Dimensions: `R` requests, `n_r` tokens of request `r` (prompt, then output), `N = sum n_r`,
`L` MoE layers, `K` top-k, `E` logical experts.

A request is its id, its arrival (in steps: it can be admitted from step `ceil(arrival)`; None
keeps the order of the set), its prompt length and the `[n_r, L, K]` logical ids of its tokens,
prompt tokens first, then one row per output token (the token a decode step runs). `-1` marks
a padded choice, as in a Trace. `traces.workload` turns a `RequestSet` into an ordinary Trace.

The file form (`save_requests` / `load_requests`, an `.npz` read with `allow_pickle=False`):
`ids [N, L, K]` (int16 when `E <= 32768`, else int32), `offsets` int64 `[R + 1]`,
`prompt_len` int64 `[R]`, `arrival` float64 `[R]` (NaN: no time), `request_id` unicode `[R]`,
`num_experts` (0-d), `meta` (a JSON string).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..base.errors import InputError
from ..base.files import atomic_file
from ..base.limits import MAX_EXPERTS, MAX_LAYERS, MAX_LOAD, MAX_TOP_K
from .trace import id_dtype, npz_names, read_npz

REQUEST_KEYS = ("ids", "offsets", "prompt_len", "arrival", "request_id", "num_experts", "meta")


@dataclass(frozen=True, eq=False)
class Request:
    """One request (module doc): `ids` `[n, L, K]` integer logical ids, `prompt_len` of them
    the prompt's, `arrival` in steps or None."""

    id: str
    prompt_len: int
    ids: np.ndarray
    arrival: float | None = None

    @property
    def output_len(self) -> int:
        """Output tokens: one decode step each."""
        return self.ids.shape[0] - self.prompt_len

    def __repr__(self) -> str:
        return (f"Request({self.id!r}, {self.prompt_len} prompt + {self.output_len} output "
                f"tokens, arrival {self.arrival})")


@dataclass(frozen=True, eq=False)
class RequestSet:
    """Checked requests with one `[L, K]` shape and `E` experts; `meta` is provenance."""

    requests: tuple[Request, ...]
    num_experts: int
    meta: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        first = self.requests[0].ids.shape
        return (f"RequestSet({len(self.requests)} requests, L={first[1]}, E={self.num_experts}, "
                f"K={first[2]})")

    def __post_init__(self) -> None:
        reqs = tuple(self.requests)
        object.__setattr__(self, "requests", reqs)
        if not reqs:
            raise InputError("a request set needs at least one request")
        E = self.num_experts
        if isinstance(E, bool) or not isinstance(E, int) or not 1 <= E <= MAX_EXPERTS:
            raise InputError(f"the number of experts must be an integer in [1, {MAX_EXPERTS}], "
                             f"got {E!r}")
        shape = None
        seen: set[str] = set()
        for r in reqs:
            where = f"request {r.id!r}"
            ids = r.ids
            if not isinstance(ids, np.ndarray) or ids.ndim != 3 or ids.dtype.kind not in "iu":
                raise InputError(f"{where}: ids must be an integer array [tokens, layers, "
                                 f"top_k]")
            if shape is None:
                shape = ids.shape[1:]
                if not (1 <= shape[0] <= MAX_LAYERS and 1 <= shape[1] <= MAX_TOP_K):
                    raise InputError(f"{where}: {shape[0]} layers and top-{shape[1]} are "
                                     f"outside [1, {MAX_LAYERS}] and [1, {MAX_TOP_K}]")
            elif ids.shape[1:] != shape:
                raise InputError(f"{where}: [layers, top_k] is {list(ids.shape[1:])}, but "
                                 f"earlier requests have {list(shape)}")
            if ids.size and (int(ids.min()) < -1 or int(ids.max()) >= E):
                raise InputError(f"{where}: ids must lie in [-1, {E}), got "
                                 f"[{int(ids.min())}, {int(ids.max())}]")
            if isinstance(r.prompt_len, bool) or not isinstance(r.prompt_len, int) \
                    or not 0 <= r.prompt_len <= ids.shape[0]:
                raise InputError(f"{where}: prompt_len must be an integer in [0, "
                                 f"{ids.shape[0]}], got {r.prompt_len!r}")
            if ids.shape[0] == 0:
                raise InputError(f"{where}: has no tokens")
            if r.arrival is not None and not (isinstance(r.arrival, (int, float))
                                              and 0 <= r.arrival <= MAX_LOAD):
                raise InputError(f"{where}: arrival must be a number of steps in [0, 2**53], "
                                 f"got {r.arrival!r}")
            if r.id in seen:
                raise InputError(f"request id {r.id!r} appears twice")
            seen.add(r.id)

    @property
    def num_layers(self) -> int:
        return self.requests[0].ids.shape[1]

    @property
    def top_k(self) -> int:
        return self.requests[0].ids.shape[2]

    def lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """`(prompt, output)` lengths, int64 `[R]` each."""
        prompt = np.array([r.prompt_len for r in self.requests], dtype=np.int64)
        total = np.array([r.ids.shape[0] for r in self.requests], dtype=np.int64)
        return prompt, total - prompt


def requests_of(ids: Sequence[np.ndarray], prompt_lens: Sequence[int], num_experts: int,
                arrivals: Sequence[float | None] | None = None,
                names: Sequence[str] | None = None, meta: dict | None = None) -> RequestSet:
    """A RequestSet from per-request `[n_r, L, K]` arrays (named `0, 1, ...` unless `names`)."""
    arrivals = [None] * len(ids) if arrivals is None else list(arrivals)
    names = [str(i) for i in range(len(ids))] if names is None else [str(n) for n in names]
    return RequestSet(tuple(Request(n, _whole(p), np.asarray(a), t)
                            for n, p, a, t in zip(names, prompt_lens, ids, arrivals)),
                      _whole(num_experts), dict(meta or {}))


def _whole(value: Any) -> Any:
    """A numpy or Python integer as an int; anything else (a float, a bool) as it is, for the
    checks to refuse rather than truncate."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return int(value)
    return value.item() if isinstance(value, np.generic) else value


def save_requests(requests: RequestSet, path: str | Path) -> None:
    """Write `requests` in the file form (module doc), atomically."""
    reqs = requests.requests
    ids = np.concatenate([r.ids for r in reqs]).astype(id_dtype(requests.num_experts))
    offsets = np.concatenate([[0], np.cumsum([r.ids.shape[0] for r in reqs])])
    arrays = {"ids": ids, "offsets": offsets.astype(np.int64),
              "prompt_len": np.array([r.prompt_len for r in reqs], dtype=np.int64),
              "arrival": np.array([math.nan if r.arrival is None else r.arrival for r in reqs],
                                  dtype=np.float64),
              "request_id": np.array([r.id for r in reqs], dtype=str),
              "num_experts": np.array(requests.num_experts, dtype=np.int64),
              "meta": np.array(json.dumps(requests.meta))}
    with atomic_file(Path(path)) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)


def is_request_file(path: str | Path) -> bool:
    """Whether `path` is an `.npz` archive holding a request set's `prompt_len` (`npz_names`:
    nothing read)."""
    return "prompt_len.npy" in npz_names(path)


def load_requests(path: str | Path) -> RequestSet:
    """A request file (module doc), checked; InputError naming the file when it is not one."""
    path = Path(path)
    data = read_npz(path, REQUEST_KEYS, "a request file")
    offsets, ids = data["offsets"], data["ids"]
    for key, kinds, what in (("offsets", "iu", "integers"), ("arrival", "fiu", "real numbers")):
        if data[key].dtype.kind not in kinds:
            raise InputError(f"{path}: its {key} must be {what}, not {data[key].dtype}")
    R = data["prompt_len"].shape[0] if data["prompt_len"].ndim == 1 else -1
    if R < 0 or offsets.shape != (R + 1,) or offsets[0] != 0 or offsets[-1] != ids.shape[0] \
            or (np.diff(offsets) < 0).any() or data["arrival"].shape != (R,) \
            or data["request_id"].shape != (R,) or ids.ndim != 3:
        raise InputError(f"{path}: inconsistent request file (offsets, ids and per-request "
                         f"arrays do not agree)")
    try:
        meta = json.loads(str(data["meta"]))
    except ValueError:
        raise InputError(f"{path}: its meta is not JSON") from None
    arrivals = [None if math.isnan(a) else float(a) for a in data["arrival"]]
    chunks = [ids[lo:hi] for lo, hi in zip(offsets[:-1], offsets[1:])]
    try:
        return requests_of(chunks, data["prompt_len"].tolist(), data["num_experts"][()],
                           arrivals, data["request_id"].tolist(), meta)
    except (InputError, TypeError, ValueError) as exc:
        raise InputError(f"{path}: {exc}") from None
