"""The `measured` cost model (DESIGN.md §8): expert compute read from NVIDIA aiconfigurator-core's
measured MoE kernel tables (Apache-2.0; the optional extra `pip install 'eplbsim[cost]'`).

Dimensions: `...` any leading dims (steps, layers), `G` GPUs = the EP size.

The table is aiconfigurator-core's `moe_perf` for the device profile's system (`DeviceProfile.
aic_system`), one framework (`trtllm` by default: aiconfigurator's default backend, whose H200
rows never beat the HBM bound; `sglang` and `vllm` too) at the version aiconfigurator itself
queries (`current` in its `systems/query_versions.yaml`, or `version`), the rows of the model
shape (hidden, expert intermediate, experts, top-k), its weight dtype (`fp8` -> `fp8_block`,
`bf16` -> `bfloat16`), no tensor parallelism and the `balanced` distribution, read with the
kernel the framework runs at the run's EP size `G`. A row `(EP, num_tokens, latency)` is the
kernel on one EP rank holding `E / EP` experts when `num_tokens` tokens are routed evenly over
all `E` (aiconfigurator's balanced routing: token `t` picks experts `(t + j ceil(E / K)) mod E`),
so that rank executes `num_tokens K / EP` pairs and, from `num_tokens >= E / K` on, reads the
weights of all its `E / EP` experts. The table's own layout thus prices a GPU by two numbers,
its pairs `n` and the experts whose weights it reads `a` (`active`: its slots with pairs, two
replicas of one expert counting twice, as the grouped GEMM over its slots reads both): the row
of the EP size whose ranks hold `a` experts (`E / a`), at the token count where such a rank
executes `n` pairs (`n EP / K`). Between token rows the latency is interpolated in log-log
(exactly the row's latency at its own token count); below the first row, the first row's
latency (a kernel with less work is not faster than its launch); above the last row, an
InputError. Between the EP sizes the table has (`a` not `E / EP` for any), linear in `a`
between the two nearest: the weights read grow with the experts. Outside them (fewer experts
than the largest EP's ranks hold, an idle GPU; more than the smallest's) the nearest EP size
stands in (`describe` says which span the table covers). Reading every GPU at the run's EP
size instead would price a GPU holding two experts (8 experts, 16 slots, 8 GPUs) as a rank
holding one, reading half the weights it reads. A shape, dtype or EP size the table lacks is
an InputError listing what it has.
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
def moe_tables(shape: ModelShape, device: DeviceProfile, num_gpus: int,
               framework: str = "trtllm", version: str = "") -> tuple[MoETable, ...]:
    """The measured curves the `measured` model reads (module doc) for `shape` on `device` in
    a run of EP size `num_gpus`: the kernel the framework runs at that EP size, at every EP
    size the table has it for this shape, the largest EP size first (the fewest experts a
    rank); `version` "" is aiconfigurator's current one. InputError when the extra is missing
    or the table lacks the device, framework, shape, dtype or the run's EP size."""
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
    points: dict[int, dict[int, float]] = {}
    for i in mine:  # the first row of each EP size and token count, in the file's order
        if rows["kernel_source"][i] == kernel:
            points.setdefault(int(rows["moe_ep_size"][i]), {}).setdefault(
                int(rows["num_tokens"][i]), float(rows["latency"][i]) * 1e-3)
    return tuple(MoETable(np.array(sorted(p), dtype=np.float64),
                          np.array([p[t] for t in sorted(p)]), system, framework, version,
                          kernel, key[4], ep, package, shape_words(*key))
                 for ep, p in sorted(points.items(), reverse=True))


def moe_table(shape: ModelShape, device: DeviceProfile, num_gpus: int,
              framework: str = "trtllm", version: str = "") -> MoETable:
    """The curve of `moe_tables` at the run's own EP size `num_gpus`: what a GPU holding
    `E / num_gpus` experts' slots, all with pairs, is priced on."""
    return next(t for t in moe_tables(shape, device, num_gpus, framework, version)
                if t.ep == num_gpus)


def _latency(table: MoETable, pairs: np.ndarray, top_k: int, experts: float) -> np.ndarray:
    """Seconds of `table`'s rank executing `pairs` (float64, any shape): its latency at `pairs
    EP / K` tokens, log-log between rows, the first row's below them; InputError above the
    last, naming `experts`, the experts a rank of its EP size holds."""
    x = pairs * table.ep / top_k
    if x.size and x.max() > table.tokens[-1]:
        raise InputError(f"a GPU executes {pairs.max():.0f} pairs on the weights of "
                         f"{experts:g} expert(s), what a balanced rank of EP {table.ep} does at "
                         f"{x.max():.0f} tokens, beyond the measured table's largest "
                         f"({table.describe()}): replay fewer tokens a step ({ROOFLINE})")
    x = np.maximum(x, table.tokens[0])
    hi = np.clip(np.searchsorted(table.tokens, x, side="right"), 1, len(table.tokens) - 1)
    x0, x1 = table.tokens[hi - 1], table.tokens[hi]
    y0, y1 = table.seconds[hi - 1], table.seconds[hi]
    t = np.log(x / x0) / np.log(x1 / x0)  # 0 at a row, exactly
    return np.where(x == x1, y1, y0 * (y1 / y0) ** t)


def measured(pairs: torch.Tensor, active: torch.Tensor, shape: ModelShape,
             device: DeviceProfile, framework: str = "trtllm",
             version: str = "") -> torch.Tensor:
    """Seconds `[..., G]` of each GPU's experts executing `pairs [..., G]` with the weights of
    `active [..., G]` experts' slots, from the measured tables (module doc): the latency of
    the EP size whose ranks hold `active` experts at the tokens where such a rank executes
    `pairs`, linear in `active` between the EP sizes the table has."""
    tables = moe_tables(shape, device, pairs.shape[-1], framework, version)
    held = np.array([shape.experts / t.ep for t in tables])  # ascending
    n = pairs.detach().cpu().to(torch.float64).numpy()
    a = np.clip(active.detach().cpu().to(torch.float64).numpy(), held[0], held[-1])
    seconds = np.zeros_like(n)
    for k, table in enumerate(tables):
        weight = np.interp(a, held, np.eye(len(held))[k])  # 1 at its own experts, exactly
        used = weight > 0
        seconds[used] += weight[used] * _latency(table, n[used], shape.top_k, held[k])
    return torch.from_numpy(seconds).to(pairs.device)


def describe(shape: ModelShape, device: DeviceProfile, num_gpus: int,
             framework: str = "trtllm", version: str = "") -> str:
    """Which tables a run of the `measured` model reads: the run's EP size's, and the span of
    experts a rank the other EP sizes give (a GPU is read at its own, module doc)."""
    tables = moe_tables(shape, device, num_gpus, framework, version)
    t = moe_table(shape, device, num_gpus, framework, version)
    return (f"aiconfigurator-core {t.package} {t.system} {t.framework} {t.version}: kernel "
            f"{t.kernel} (EP {t.ep}'s), {t.shape}, {DISTRIBUTION}, {t.tokens[0]:.0f}-"
            f"{t.tokens[-1]:.0f} tokens, EP {tables[0].ep}-{tables[-1].ep}: a GPU at its "
            f"own experts")
