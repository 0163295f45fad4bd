"""The `measured` cost model (DESIGN.md §8): expert compute read from NVIDIA aiconfigurator-core's
measured MoE kernel tables (Apache-2.0; the optional extra `pip install 'eplbsim[cost]'`).

Dimensions: `...` any leading dims (steps, layers), `G` GPUs = the EP size.

The table is aiconfigurator-core's `moe_perf` for the device profile's system (`DeviceProfile.
aic_system`), one framework (`trtllm` by default: aiconfigurator's default backend, whose H200
rows never beat the HBM bound; `sglang` and `vllm` too) at the version aiconfigurator itself
queries (`current` in its `systems/query_versions.yaml`, or `version`), the rows of the model
shape (hidden, expert intermediate, experts, top-k), its weight dtype (`fp8` -> `fp8_block`,
`bf16` -> `bfloat16`), no tensor parallelism, EP size `G` and the `balanced` distribution. A
row `(num_tokens, latency)` is one EP rank's MoE kernel when `num_tokens` tokens are routed
evenly over all experts, so that rank executes `num_tokens K / G` pairs. A GPU executing `n`
pairs therefore takes the latency at `n G / K` tokens, interpolated in log-log between rows
(exactly the row's latency at its own token count); below the first row, the first row's
latency (a kernel with less work is not faster than its launch); above the last row, an
InputError. A shape, dtype or EP size the table lacks is an InputError listing what it has.
Slots' weights (`active`) are in the measurement and not read again.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from ..base.errors import InputError
from .devices import DeviceProfile
from .shapes import ModelShape

EXTRA = "pip install 'eplbsim[cost]'"
FRAMEWORKS = ("trtllm", "sglang", "vllm")
DTYPES = {"fp8": "fp8_block", "bf16": "bfloat16", "fp16": "float16"}
DISTRIBUTION = "balanced"
COLUMNS = ["kernel_source", "moe_dtype", "num_tokens", "hidden_size", "inter_size", "topk",
           "num_experts", "moe_tp_size", "moe_ep_size", "distribution", "latency"]

ROOFLINE = "--cost roofline prices every model on every device"  # said with each refusal

@dataclass(frozen=True, eq=False)
class MoETable:
    """One measured latency curve: `tokens` float64 `[n]` ascending, `seconds` `[n]`, and where
    it comes from."""

    tokens: np.ndarray
    seconds: np.ndarray
    system: str
    framework: str
    version: str
    kernel: str
    dtype: str
    ep: int
    package: str
    shape: str

    def describe(self) -> str:
        """The table, kernel and shape read, in one line of under 200 characters."""
        return (f"aiconfigurator-core {self.package} {self.system} {self.framework} "
                f"{self.version}: kernel {self.kernel}, {self.shape}, EP {self.ep}, "
                f"{DISTRIBUTION}, {self.tokens[0]:.0f}-{self.tokens[-1]:.0f} tokens")


def shape_words(hidden: int, intermediate: int, experts: int, top_k: int, dtype: str) -> str:
    """A table's shape key in a few characters: `H 7168 I 2048 E 256 K 8 fp8_block`."""
    return f"H {hidden} I {intermediate} E {experts} K {top_k} {dtype}"


def nearest(key: tuple, keys: set, most: int = 3) -> list[tuple]:
    """The `most` shape keys `(H, I, E, K, dtype)` of `keys` nearest `key`: the same experts,
    top-k and dtype first, then the least log-distance in hidden and intermediate sizes."""
    def distance(other: tuple) -> tuple:
        h, i, e, k, d = other
        return (e != key[2], k != key[3], d != key[4],
                abs(np.log(h / key[0])) + abs(np.log(i / key[1])), other)
    return sorted(keys, key=distance)[:most]


def _package() -> tuple[Any, Any, Any, str]:
    """aiconfigurator-core's data root, `pyarrow.parquet` and `yaml`, and the package version;
    InputError naming the extra when they are not installed."""
    try:
        import importlib.resources as resources

        import pyarrow.parquet as pq
        import yaml
        root = resources.files("aiconfigurator_core") / "systems"
    except ImportError:
        raise InputError(f"the measured cost model reads NVIDIA aiconfigurator-core's tables, "
                         f"which are not installed: {EXTRA} ({ROOFLINE})") from None
    return root, pq, yaml, importlib.metadata.version("aiconfigurator-core")


def _version(root: Any, yaml: Any, system: str, framework: str) -> str:
    """The version of `framework` aiconfigurator queries on `system` (`current`)."""
    slots = yaml.safe_load((root / "query_versions.yaml").read_text())
    chosen = slots.get("overrides", {}).get(system, {}).get(framework) or \
        slots["defaults"][framework]
    return str(chosen["current"])


@lru_cache(maxsize=64)
def moe_table(shape: ModelShape, device: DeviceProfile, num_gpus: int,
              framework: str = "trtllm", version: str = "") -> MoETable:
    """The measured curve the `measured` model reads (module doc) for `shape` on `device` with
    EP size `num_gpus`; `version` "" is aiconfigurator's current one. InputError when the extra
    is missing or the table lacks the device, framework, shape, dtype or EP size."""
    if framework not in FRAMEWORKS:
        raise InputError(f"unknown framework {framework!r} for the measured cost model; "
                         f"choose one of {', '.join(FRAMEWORKS)}")
    root, pq, yaml, package = _package()
    system = device.aic_system
    if not system:
        raise InputError(f"this device profile has no aiconfigurator-core tables (profiles with "
                         f"tables: h100-sxm, h200, b200, gb200; {ROOFLINE})")
    version = version or _version(root, yaml, system, framework)
    path = root / "data" / system / "moe" / framework / version / "moe_perf.parquet"
    if not path.is_file():
        raise InputError(f"aiconfigurator-core {package} has no {framework} {version} MoE "
                         f"table for {system} ({ROOFLINE})")
    rows = pq.read_table(path, columns=COLUMNS, filters=[
        ("moe_tp_size", "=", 1), ("distribution", "=", DISTRIBUTION)]).to_pydict()
    key = (shape.hidden, shape.intermediate, shape.experts, shape.top_k,
           DTYPES.get(shape.weight_dtype))
    keys = list(zip(rows["hidden_size"], rows["inter_size"], rows["num_experts"], rows["topk"],
                    rows["moe_dtype"]))
    mine = [i for i, k in enumerate(keys) if k == key]
    where = f"the {framework} {version} table for {system}"
    if not mine:
        near = "; ".join(shape_words(*k) for k in nearest(key, set(keys)))
        raise InputError(f"{where} has no MoE kernel of "
                         f"{shape_words(*key[:4], key[4] or shape.weight_dtype)}; nearest of "
                         f"its {len(set(keys))} shapes: {near} ({ROOFLINE})")
    at_ep = [i for i in mine if rows["moe_ep_size"][i] == num_gpus]
    if not at_ep:
        eps = sorted({rows["moe_ep_size"][i] for i in mine})
        raise InputError(f"{where} has this shape at EP sizes {', '.join(map(str, eps))}, not "
                         f"at {num_gpus} GPUs ({ROOFLINE})")
    kernel = sorted({rows["kernel_source"][i] for i in at_ep})[0]
    points: dict[int, float] = {}
    for i in at_ep:  # the first row of each token count, in the file's order
        if rows["kernel_source"][i] == kernel:
            points.setdefault(int(rows["num_tokens"][i]), float(rows["latency"][i]) * 1e-3)
    tokens = np.array(sorted(points), dtype=np.float64)
    return MoETable(tokens, np.array([points[t] for t in sorted(points)]), system, framework,
                    version, kernel, key[4], num_gpus, package, shape_words(*key))


def measured(pairs: torch.Tensor, active: torch.Tensor, shape: ModelShape,
             device: DeviceProfile, framework: str = "trtllm",
             version: str = "") -> torch.Tensor:
    """Seconds `[..., G]` of each GPU's experts executing `pairs [..., G]`, from the measured
    table (module doc): the latency at `pairs G / K` tokens, log-log between rows."""
    table = moe_table(shape, device, pairs.shape[-1], framework, version)
    x = pairs.detach().cpu().to(torch.float64).numpy() * pairs.shape[-1] / shape.top_k
    if x.size and x.max() > table.tokens[-1]:
        raise InputError(f"a GPU executes {x.max() * shape.top_k / pairs.shape[-1]:.0f} pairs, "
                         f"what a balanced rank does at {x.max():.0f} tokens, beyond the measured "
                         f"table's largest ({table.describe()}): replay fewer tokens a step "
                         f"({ROOFLINE})")
    x = np.maximum(x, table.tokens[0])
    hi = np.clip(np.searchsorted(table.tokens, x, side="right"), 1, len(table.tokens) - 1)
    x0, x1 = table.tokens[hi - 1], table.tokens[hi]
    y0, y1 = table.seconds[hi - 1], table.seconds[hi]
    t = np.log(x / x0) / np.log(x1 / x0)  # 0 at a row, exactly
    seconds = np.where(x == x1, y1, y0 * (y1 / y0) ** t)
    return torch.from_numpy(seconds).to(pairs.device)


def describe(shape: ModelShape, device: DeviceProfile, num_gpus: int,
             framework: str = "trtllm", version: str = "") -> str:
    """Which table a run of the `measured` model reads."""
    return moe_table(shape, device, num_gpus, framework, version).describe()
