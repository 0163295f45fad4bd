"""vLLM's own EPLB code, run in the simulator, from any release or checkout (DESIGN.md §11).

Dimensions: `L` layers, `E` logical experts, `P` physical slots, `R` max replicas, `T` tokens,
`K` top-k.

- `DefaultEplbPolicy` (`vllm/distributed/eplb/policy/default.py`) loads as it is: it imports
  only numpy, torch and its abstract base; the policy package's `__init__` (which reads vLLM's
  config) is not run. So does `FlashlbEplbPolicy` (`policy/flashlb.py`, numba), where a source
  has it (vLLM's main branch).
- `compute_logical_maps` (`eplb_state.py`) is compiled alone from its file, keeping file name
  and line numbers, because that module imports the serving stack.
- The map kernel `eplb_map_to_physical_and_record` (`fused_moe/router/base_router.py`) loads
  with its module. What that module imports from the rest of vLLM is the real file when it loads
  alone (0.34.0's `fused_moe/eplb_triton.py`, which holds the hash the kernel calls), else an
  inert stand-in (`standins`). The adapter supplies what carries meaning: `triton_utils` (Triton
  itself) and the platform. vLLM defines the kernel only on CUDA-like platforms (on a CPU
  platform it maps nothing), so the platform says CUDA-like, and the kernel is defined and runs
  under Triton's interpreter (`TRITON_INTERPRET=1` while it is defined), which needs triton.
  The interpreter runs a kernel one program instance at a time, so a launch of the map's
  kernel (`WHOLE_LAUNCH`: elementwise, each element masked by `offs < numel` and hashed by its
  own token index, with no reduction across a block; `router/base_router.py` of 0.33.0 and
  0.34.0) is given one block of the whole batch: its `BLOCK_SIZE`, a launch parameter the grid
  is computed from, is the next power of two at or above `numel` (the same value for every
  element, from one program instance instead of `numel / 256`).
- On a CUDA device (`topk_ids` there) the same module is loaded a second time without the
  interpreter (`native`, its own module set), and the kernel compiles and runs on the GPU as vLLM
  launches it, at its own block size.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from ..base.errors import InputError
from ..placement import refuse_empty_slots
from . import identity
from .source import Modules, call, interpreted
from .standins import StandInModule, stand_in

PINNED = "0.33.0"
PACKAGE = "vllm"
KEEP = ("vllm/distributed/eplb/", "vllm/model_executor/layers/fused_moe/router/base_router.py",
        "vllm/model_executor/layers/fused_moe/eplb_triton.py", "vllm/version.py",
        "vllm/_version.py")  # what a fetch keeps of a wheel: paths starting so
POLICY = "vllm.distributed.eplb.policy.default"
FLASHLB = "vllm.distributed.eplb.policy.flashlb"  # on vLLM's main branch; no release up to 0.34
ROUTER = "vllm.model_executor.layers.fused_moe.router.base_router"
WHOLE_LAUNCH = ("_eplb_map_and_record_i32_kernel",)  # elementwise kernels launched as one block
EXPOSES = {
    "DefaultEplbPolicy.rebalance_experts": "solver: default",
    "FlashlbEplbPolicy.rebalance_experts": "solver: flashlb (a checkout of vLLM's main branch; "
                                           "no release up to 0.34.0 has it)",
    "compute_logical_maps": "every rank's candidate lists and counts",
    "eplb_map_to_physical_and_record": "dispatch (Knuth hash of the token index), under the "
                                       "Triton interpreter",
}


class VLLM:
    """vLLM's EPLB functions from the engine source `root` (the folder holding `vllm/`),
    labelled `label`."""

    engine = PACKAGE

    def __init__(self, root: Path, label: str) -> None:
        self.root, self.label = Path(root), label
        self.prefix = identity.register(self.root)
        self.modules = Modules(self.root, PACKAGE, _stubs(), label)
        self.native = Modules(self.root, PACKAGE, _stubs(), label)  # compiled kernels: CUDA
        ranks = identity.getters("vllm", identity.VLLM_GETTERS, identity.VLLM_GROUPS)
        for modules in (self.modules, self.native):
            for package in ("vllm.distributed", "vllm.distributed.parallel_state"):
                modules.supply(package, **ranks)  # the rank's groups, answered per rank
        self._found: dict[str, Any] = {}

    def as_rank(self, who: "identity.Identity", function: str) -> Any:
        """The block's calls into this source run as `who` (`identity.as_rank`: every channel
        answers it; an exception of the engine's names `function`)."""
        return identity.as_rank(who, self.prefix, self.label, function)

    def _get(self, what: str) -> Any:
        """`DefaultEplbPolicy` ("default"), `compute_logical_maps` ("views") or the map kernel
        ("hash" interpreted, "native" compiled for CUDA), loaded once; or why it cannot be,
        as text."""
        if what not in self._found:
            try:
                self._found[what] = FINDERS[what](self)
            except InputError as exc:
                self._found[what] = str(exc)
            except Exception as exc:  # an engine module that does not load here: say why
                self._found[what] = f"it does not load ({type(exc).__name__}: {exc})"
        return self._found[what]

    def missing(self, algorithm: str) -> str | None:
        """Why `algorithm` ("hash", "default", "flashlb" or "views") cannot run from this
        source, or None when it can."""
        found = self._get(algorithm)
        return found if isinstance(found, str) else None

    def need(self, algorithm: str) -> Any:
        """What `algorithm` calls (`missing`); InputError, in one line, when it cannot run."""
        found = self._get(algorithm)
        if isinstance(found, str):
            raise InputError(f"{self.label} cannot run {algorithm}: {found}")
        return found

    @property
    def policy(self) -> Any:
        return self.need("default")

    def _default_policy(self) -> Any:
        default = self.modules.load(POLICY)
        if not hasattr(default, "DefaultEplbPolicy"):
            raise InputError(f"{POLICY} has no DefaultEplbPolicy")
        return default.DefaultEplbPolicy

    def _flashlb_policy(self) -> Any:
        module = self.modules.load(FLASHLB)
        if not hasattr(module, "FlashlbEplbPolicy"):
            raise InputError(f"{FLASHLB} has no FlashlbEplbPolicy")
        return module.FlashlbEplbPolicy

    def _logical_maps(self) -> Any:
        return self.modules.extract("vllm.distributed.eplb.eplb_state", ("compute_logical_maps",),
                                    {"torch": torch})["compute_logical_maps"]

    def solve(self, load: torch.Tensor, num_slots: int, num_gpus: int, num_nodes: int,
              num_groups: int, algorithm: str = "default") -> torch.Tensor:
        """The policy `algorithm`'s `rebalance_experts(load [L, E], ...)` -> phy2log `[L, P]`:
        `DefaultEplbPolicy` ("default"), or `FlashlbEplbPolicy` ("flashlb", in vLLM's main
        branch; a new instance a call, as it keeps a window of past loads, placing afresh:
        no previous placement)."""
        policy = self.policy if algorithm == "default" else self.need(algorithm)()
        with self.modules.active(), identity.for_every_rank(
                num_gpus, num_nodes, self.prefix, self.label, "rebalance_experts"):
            out = call(policy.rebalance_experts, self.label, weight=load.clone(),
                       num_replicas=num_slots, num_groups=num_groups, num_nodes=num_nodes,
                       num_ranks=num_gpus, num_gpus=num_gpus, old_global_expert_indices=None)
        return (out[0] if isinstance(out, tuple) else out).long()  # (phy2log, maps...) or it

    def logical_maps(self, phy2log: torch.Tensor, num_experts: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """`compute_logical_maps(phy2log [L, P], E)` -> `(log2phy [L, E, R], counts [L, E])`;
        InputError in one line for a `phy2log` with an empty slot (-1), which the engine's
        code would count as an expert."""
        refuse_empty_slots(phy2log, f"{self.label}'s compute_logical_maps")
        maps = self.need("views")
        with self.modules.active(), identity.for_every_rank(
                1, 1, self.prefix, self.label, "compute_logical_maps"):  # every rank's lists
            return maps(phy2log, num_experts)

    def map_kernel(self) -> Any:
        """`eplb_map_to_physical_and_record`, its module loaded under the Triton interpreter."""
        return self.need("hash")

    def _map_kernel(self, native: bool = False) -> Any:
        if importlib.util.find_spec("triton") is None:
            raise InputError("vLLM's map kernel is Triton code; install triton (the dev extra "
                             "has it)")
        if native:
            router = self.native.load(ROUTER)
        else:
            with interpreted():
                router = self.modules.load(ROUTER)
        kernel = getattr(router, "eplb_map_to_physical_and_record", None)
        if kernel is None:
            raise InputError(f"{ROUTER} has no eplb_map_to_physical_and_record")
        if not native:
            launch_whole(vars(router), True)
        return kernel

    def whole_launch(self, on: bool) -> None:
        """Launch the map's kernel as one block (`on`, what loading it sets: module doc) or at
        the block size vLLM's own wrapper gives it (what the engine's code as it comes costs,
        `benchmarks/bench_engines.py`)."""
        launch_whole(self.map_kernel().__globals__, on)

    def dispatch(self, topk_ids: torch.Tensor, log2phy: torch.Tensor, counts: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The map kernel on one layer's `topk_ids [T, K]` with that layer's `log2phy [E, R]`
        and `counts [E]`, recording on -> `(phys int64 [T, K], recorded load int64 [P])` on
        `topk_ids`' device, P the slots `log2phy` names (at least its largest id + 1). On a
        CUDA device the kernel runs compiled (`native`), elsewhere interpreted."""
        native = topk_ids.is_cuda
        kernel = self.need("native") if native else self.map_kernel()
        dev = topk_ids.device
        slots = max(int(log2phy.max()) + 1, 1)
        load = torch.zeros(slots, dtype=torch.int64, device=dev)
        with (self.native if native else self.modules).active():
            phys = call(kernel, self.label, topk_ids=topk_ids.to(torch.int64).contiguous(),
                        expert_load_view=load,
                        logical_to_physical_map=log2phy.to(dev).contiguous(),
                        logical_replica_count=counts.to(dev).contiguous(),
                        record_enabled=torch.ones(1, dtype=torch.bool, device=dev))
        return phys.long(), load


FINDERS = {"default": VLLM._default_policy, "flashlb": VLLM._flashlb_policy,
           "views": VLLM._logical_maps,
           "hash": VLLM._map_kernel,
           "native": lambda run: run._map_kernel(native=True)}  # what each algorithm
# calls, and how it is found ("native": the map kernel compiled, for CUDA inputs)


def _stubs() -> dict[str, ModuleType]:
    """What the adapter supplies (module doc): Triton through vLLM's shim, and a CUDA-like
    platform (the kernel is defined there only)."""
    shim = ModuleType("vllm.triton_utils")
    try:
        shim.triton = importlib.import_module("triton")
        shim.tl = importlib.import_module("triton.language")
        shim.HAS_TRITON = True
    except ImportError:  # the map kernel says so when it is asked for
        pass
    sync = ModuleType("vllm.utils.gpu_sync_debug")  # the rebalance allows host syncs by it
    sync.gpu_sync_allowed = contextlib.nullcontext
    state = stand_in(ModuleType("vllm.distributed.parallel_state"), "the serving stack's "
                     "process groups: the EP group is handed in", PACKAGE)
    state.is_local_first_rank = lambda: False  # the communicator logs its start there only
    envs = stand_in(ModuleType("vllm.envs"), "vLLM's environment settings: only the rank's "
                    "are read here", PACKAGE)
    envs.__class__ = _Envs
    platforms = ModuleType("vllm.platforms")
    platforms.current_platform = SimpleNamespace(
        is_cuda_alike=lambda: True, is_cuda=lambda: True, is_rocm=lambda: False,
        is_xpu=lambda: False, is_cpu=lambda: False, device_type="cuda")
    return {m.__name__: m for m in (shim, platforms, sync, state, envs)}


class _Envs(StandInModule):
    """`vllm.envs`: the rank's variables (`identity.ENVIRONMENT`: `envs.LOCAL_RANK` and kin)
    read from the environment as vLLM's `envs` reads them (an int, "0" when unset), which
    answers the rank during its call; any other name a stand-in."""

    def __getattr__(self, name: str) -> Any:
        if name in identity.ENVIRONMENT:
            return int(os.environ.get(name, "0"))
        return super().__getattr__(name)


def launch_whole(scope: dict[str, Any], on: bool) -> None:
    """The kernels of `WHOLE_LAUNCH` in a loaded module's globals `scope` wrapped in
    `WholeLaunch` (`on`), or bare."""
    for name in WHOLE_LAUNCH:
        kernel = scope.get(name)
        if kernel is not None:
            bare = kernel.kernel if isinstance(kernel, WholeLaunch) else kernel
            scope[name] = WholeLaunch(bare) if on else bare


class WholeLaunch:
    """An interpreted elementwise Triton kernel whose launches run as one program instance:
    `kernel[grid](..., numel, ..., BLOCK_SIZE=b)` runs with `BLOCK_SIZE` the next power of two
    at or above `numel` (at least `b`), the grid computed from it as the caller's grid function
    says (module doc). A launch without `numel` among the kernel's arguments runs as given."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        names = list(getattr(kernel, "arg_names", ()))
        self.numel = names.index("numel") if "numel" in names else None

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            numel = kwargs.get("numel", args[self.numel] if self.numel is not None
                               and self.numel < len(args) else None)
            if isinstance(numel, int) and "BLOCK_SIZE" in kwargs:
                whole = 1 << max(numel - 1, 0).bit_length()  # the next power of two
                kwargs["BLOCK_SIZE"] = max(kwargs["BLOCK_SIZE"], whole)
            return self.kernel[grid](*args, **kwargs)
        return launch
