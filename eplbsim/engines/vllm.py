"""vLLM's own EPLB code, run in the simulator: the adapter for vLLM 0.33.0 (DESIGN.md §11).

Dimensions: `L` layers, `E` logical experts, `P` physical slots, `R` max replicas, `T` tokens,
`K` top-k.

- `DefaultEplbPolicy` (`vllm/distributed/eplb/policy/default.py`) loads as it is: it imports
  only numpy, torch and its abstract base; the policy package's `__init__` (which reads vLLM's
  config) is not run.
- `compute_logical_maps` (`eplb_state.py`) and the map kernel `eplb_map_to_physical_and_record`
  with its Triton kernel (`fused_moe/router/base_router.py`) are compiled alone from their files,
  keeping file names and line numbers, because those modules import the serving stack. The
  kernel is defined only on CUDA-like platforms (on a CPU platform vLLM maps nothing); here it
  runs under Triton's interpreter (`TRITON_INTERPRET=1` while it is defined), which needs triton.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import InputError
from .source import Modules, interpreted

VERSION = "0.33.0"
PACKAGE = "vllm"
_EPLB = "vllm/distributed/eplb/"
_ROUTER = "vllm/model_executor/layers/fused_moe/router/base_router.py"
FILES = (
    _EPLB + "policy/abstract.py",
    _EPLB + "policy/default.py",
    _EPLB + "eplb_state.py",
    _ROUTER,
)
MAP_FUNCTIONS = ("_eplb_map_and_record_i32_kernel", "_eplb_map_and_record_triton",
                 "eplb_map_to_physical_and_record")
EXPOSES = {
    "DefaultEplbPolicy.rebalance_experts": "solver: default",
    "compute_logical_maps": "every rank's candidate lists and counts",
    "eplb_map_to_physical_and_record": "dispatch (Knuth hash of the token index), under the "
                                       "Triton interpreter",
}


class VLLM:
    """vLLM 0.33.0's EPLB functions from the engine source `root` (the folder holding `vllm/`),
    labelled `label`."""

    engine = PACKAGE
    version = VERSION

    def __init__(self, root: Path, label: str) -> None:
        self.root, self.label = Path(root), label
        self.modules = Modules(self.root, PACKAGE, {})
        try:
            default = self.modules.load("vllm.distributed.eplb.policy.default")
        except InputError:
            raise
        except Exception as exc:
            raise InputError(f"{label}: vllm.distributed.eplb.policy.default does not load "
                             f"({type(exc).__name__}: {exc}); the adapter is for vLLM "
                             f"{VERSION}") from None
        if not hasattr(default, "DefaultEplbPolicy"):
            raise InputError(f"{label}: vllm.distributed.eplb.policy.default has no "
                             f"DefaultEplbPolicy (the adapter is for vLLM {VERSION})")
        self.policy = default.DefaultEplbPolicy
        self._maps = self.modules.extract("vllm.distributed.eplb.eplb_state",
                                          ("compute_logical_maps",), {"torch": torch})
        self._kernel: dict | None = None

    def solve(self, load: torch.Tensor, num_slots: int, num_gpus: int, num_nodes: int,
              num_groups: int) -> torch.Tensor:
        """`DefaultEplbPolicy.rebalance_experts(load [L, E], ...)` -> phy2log `[L, P]`."""
        with self.modules.active():
            return self.policy.rebalance_experts(load, num_slots, num_groups, num_nodes,
                                                 num_gpus).long()

    def logical_maps(self, phy2log: torch.Tensor, num_experts: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """`compute_logical_maps(phy2log [L, P], E)` -> `(log2phy [L, E, R], counts [L, E])`."""
        with self.modules.active():
            return self._maps["compute_logical_maps"](phy2log, num_experts)

    def map_kernel(self) -> Any:
        """`eplb_map_to_physical_and_record`, defined under the Triton interpreter."""
        if self._kernel is None:
            try:
                import triton
                import triton.language as tl
            except ImportError:
                raise InputError(f"{self.label}: vLLM's map kernel is Triton code; install "
                                 f"triton (the dev extra has it)") from None
            with interpreted():
                self._kernel = self.modules.extract(
                    "vllm.model_executor.layers.fused_moe.router.base_router", MAP_FUNCTIONS,
                    {"torch": torch, "triton": triton, "tl": tl})
        return self._kernel["eplb_map_to_physical_and_record"]

    def dispatch(self, topk_ids: torch.Tensor, log2phy: torch.Tensor, counts: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The map kernel on one layer's `topk_ids [T, K]` with that layer's `log2phy [E, R]`
        and `counts [E]`, recording on -> `(phys int64 [T, K], recorded load int64 [P])`, P the
        slots `log2phy` names (at least its largest id + 1)."""
        kernel = self.map_kernel()
        slots = max(int(log2phy.max()) + 1, 1)
        load = torch.zeros(slots, dtype=torch.int64)
        with self.modules.active():
            phys = kernel(topk_ids.to(torch.int64).contiguous(), load, log2phy.contiguous(),
                          counts.contiguous(), torch.ones(1, dtype=torch.bool))
        return phys.long(), load
