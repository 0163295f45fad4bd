"""Device profiles for the cost model (DESIGN.md §8): per-GPU peaks and link bandwidths.

Figures are vendors' published peaks, dense (no sparsity), per GPU; link bandwidths are per GPU
per direction. `latency_s` and `launch_s` are modelling floors, not measurements: a
communication phase costs at least `latency_s`, an expert kernel at least `launch_s`. Any field
can be overridden with `dataclasses.replace`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from ..base.errors import InputError

TERA = 1e12
GIGA = 1e9


@dataclass(frozen=True)
class DeviceProfile:
    """flops: dense FLOP/s by weight dtype (fp8 or bf16, as `ModelShape.weight_dtype`); hbm:
    bytes/s; nvlink, rdma: bytes/s per GPU per direction (within a node and between nodes;
    a GB200 NVL72 rack is one node of 72 GPUs for the topology); aic_system: the system whose
    measured tables aiconfigurator-core holds for this device ("" when it holds none)."""

    flops_bf16: float
    flops_fp8: float
    hbm: float
    nvlink: float
    rdma: float
    latency_s: float = 5e-6
    launch_s: float = 5e-6
    source: str = ""
    aic_system: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("source", "aic_system"):
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) \
                    or not math.isfinite(value) or value < 0 \
                    or (value == 0 and f.name not in ("latency_s", "launch_s")):
                raise InputError(f"a device profile's {f.name} must be a positive number, "
                                 f"got {value!r}")

    def peak_flops(self, weight_dtype: str) -> float:
        """Dense FLOP/s at which experts with `weight_dtype` weights run (fp16 as bf16, fp32 at
        half of it; 8-bit and 4-bit weights at the FP8 peak, the fastest a profile states, so
        the roofline stays a lower bound)."""
        if weight_dtype not in ("bf16", "fp16", "fp32"):
            return self.flops_fp8
        return self.flops_bf16 / (2 if weight_dtype == "fp32" else 1)


_HOPPER = "NVIDIA H100/H200 datasheets: 989 TFLOP/s BF16, 1979 FP8 dense; NVLink 4 900 GB/s " \
          "bidirectional; ConnectX-7 400 Gb/s per GPU"

DEVICES: dict[str, DeviceProfile] = {
    "h100-sxm": DeviceProfile(989 * TERA, 1979 * TERA, 3.35 * TERA, 450 * GIGA, 50 * GIGA,
                              source=_HOPPER + "; HBM3 3.35 TB/s", aic_system="h100_sxm"),
    "h200": DeviceProfile(989 * TERA, 1979 * TERA, 4.8 * TERA, 450 * GIGA, 50 * GIGA,
                          source=_HOPPER + "; HBM3e 4.8 TB/s", aic_system="h200_sxm"),
    "h800": DeviceProfile(989 * TERA, 1979 * TERA, 3.35 * TERA, 200 * GIGA, 50 * GIGA,
                          source="H100's compute and HBM with NVLink cut to 400 GB/s "
                          "bidirectional (DeepEP's test machine, with CX7 400 Gb/s)"),
    "b200": DeviceProfile(2250 * TERA, 4500 * TERA, 8 * TERA, 900 * GIGA, 50 * GIGA,
                          source="NVIDIA HGX B200 datasheet: 2.25 PFLOP/s BF16, 4.5 FP8 dense "
                          "per GPU; HBM3e 8 TB/s; NVLink 5 1.8 TB/s bidirectional; 400 Gb/s NIC",
                          aic_system="b200_sxm"),
    "gb200": DeviceProfile(2500 * TERA, 5000 * TERA, 8 * TERA, 900 * GIGA, 100 * GIGA,
                           source="NVIDIA GB200 NVL72 datasheet per GPU (180 PFLOP/s BF16, "
                           "360 FP8 dense over 72); NVLink 5 1.8 TB/s bidirectional across 72 "
                           "GPUs; 800 Gb/s ConnectX-8 per GPU", aic_system="gb200"),
    "mi300x": DeviceProfile(1307 * TERA, 2615 * TERA, 5.3 * TERA, 448 * GIGA, 50 * GIGA,
                            source="AMD Instinct MI300X datasheet: 1307 TFLOP/s BF16, 2615 FP8 "
                            "dense; HBM3 5.3 TB/s; 7 Infinity Fabric links of 64 GB/s per "
                            "direction; 400 Gb/s NIC"),
    "mi355x": DeviceProfile(2516 * TERA, 5033 * TERA, 8 * TERA, 537.6 * GIGA, 50 * GIGA,
                            source="AMD Instinct MI355X: 256 CUs at 2.4 GHz, 8192 FP8 FLOP a "
                            "clock per CU (ISSCC 2026) = 5.03 PFLOP/s FP8 dense, half at BF16; "
                            "HBM3E 8 TB/s; 7 Infinity Fabric links of 153.6 GB/s bidirectional; "
                            "400 Gb/s NIC"),
}
