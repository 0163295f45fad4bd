"""vLLM's asynchronous rebalance, run on simulated ranks (DESIGN.md §14): the engine's own
async worker (`async_worker.transfer_run_periodically`: per layer, an all-reduced "still
rebalancing" flag, then `transfer_layer` into the rank's buffer through its communicator, then
the layer posted as `pending_result` and the worker waiting on its `CpuGpuEvent`), and the main
thread's own `eplb_state._move_to_workspace` (`move_from_buffer` into the weights, then
`_commit_eplb_maps_for_layer`: that layer's maps switch), unmodified.

Dimensions: `G` ranks, `L` layers, `E` logical experts, `P` physical slots, `R` a map's
replica columns (`P - E + 1`, the most one expert can have), `W` tensors a layer.

What the adapter stands in for (`RankState` and `stand_ins`), and why it is not the engine's
logic:
- the serving stack's `EplbState` and `EplbModelState` (their module imports the whole
  server): plain objects holding the fields the worker and `_move_to_workspace` read: the
  rank's weights and buffers, its committed maps (`physical_to_logical_map [L, P]`,
  `logical_to_physical_map [L, E, R]`, `logical_replica_count [L, E]`), its communicator
  (`TorchDistNcclEplbCommunicator` on the EP group), and a policy whose `rebalance_experts`
  answers the placement eplbsim's solver chose (the solver is a separate choice, as in the
  synchronous path);
- the trigger (`rearrange_event`): the first wait returns (the rebalance was asked for), the
  next one ends the worker's thread (`Done`): one rearrangement a call;
- the accelerator: on the CPU work is in order, so `torch.Event`'s record and wait and
  `torch.accelerator`'s current stream do nothing (`stand_ins`); the engine's own
  `CpuGpuEvent` still orders the two threads with its `threading.Event`;
- `get_eplb_group()`: the rank's group in the simulated world.

The schedule is vLLM's "one EPLB layer transfer per model forward pass" with every transfer
done within its pass: before each step the driver (`migration.migrate_async`) waits until every
rank's worker posted its layer, then runs each rank's `_move_to_workspace`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any, Callable, Iterator

import torch

from ..base.errors import InputError
from ..base.patching import patched
from .vllm import VLLM
from .vllm_rearrange import modules

WORKER = "vllm.distributed.eplb.async_worker"
STATE = "vllm.distributed.eplb.eplb_state"
MAIN = ("_move_to_workspace", "_commit_eplb_maps_for_layer", "_pad_out_tensor",
        "compute_logical_maps")  # what the main thread runs, from eplb_state.py


class Done(Exception):
    """Ends a worker's thread at its next wait for a rearrangement (module doc)."""


class _Trigger:
    """`rearrange_event`: the first wait returns, the next raises `Done`."""

    def __init__(self) -> None:
        self.fired = False

    def wait(self, stream: Any = None) -> None:
        if self.fired:
            raise Done
        self.fired = True


class _InOrderEvent:
    """`torch.Event` on the CPU, where work runs in order: nothing to record or wait for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


@dataclass(frozen=True)
class AsyncCode:
    """vLLM's asynchronous rebalance, loaded from a release's own files.

    worker: the async worker's module (`transfer_run_periodically`)
    comm:   the communicator's module (`TorchDistNcclEplbCommunicator`)
    main:   the main thread's functions extracted from eplb_state.py, `MAIN` by name
    """

    worker: ModuleType
    comm: ModuleType
    main: dict[str, Callable]


def load(run: VLLM) -> AsyncCode:
    """vLLM's asynchronous rebalance from `run`'s source (`AsyncCode`); InputError naming the
    file a release lacks."""
    for name in (WORKER, STATE):
        if not run.root.joinpath(*name.split(".")).with_suffix(".py").is_file():
            raise InputError(f"{run.label}: no {name.replace('.', '/')}.py (vLLM's async "
                             f"rebalance is not in this release)")
    rebalance, comm = modules(run)
    try:
        worker = run.modules.load(WORKER)
    except InputError:
        raise
    except Exception as exc:  # a release whose modules do not load here: say why
        raise InputError(f"{run.label}: {WORKER} does not load ({type(exc).__name__}: "
                         f"{exc})") from None
    if not hasattr(worker, "transfer_run_periodically"):
        raise InputError(f"{run.label}: {WORKER} has no transfer_run_periodically")
    names = {"torch": torch, "PIN_MEMORY": False, "move_from_buffer": rebalance.move_from_buffer,
             "EplbModelState": Any,
             "gpu_sync_allowed": run.modules.load("vllm.utils.gpu_sync_debug").gpu_sync_allowed}
    main = run.modules.extract(STATE, MAIN, names)
    return AsyncCode(worker=worker, comm=comm, main=main)


def committed(loaded: AsyncCode, old: torch.Tensor, num_experts: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The maps a rank holds for `old [L, P]`: `logical_to_physical_map [L, E, R]` (-1
    padded) and `logical_replica_count [L, E]`, by the engine's `compute_logical_maps`."""
    L, P = old.shape
    maps, counts = loaded.main["compute_logical_maps"](old, num_experts)
    log2phy = torch.full((L, num_experts, P - num_experts + 1), -1, dtype=maps.dtype)
    log2phy[..., :maps.shape[-1]] = maps
    return log2phy, counts


def rank_state(loaded: AsyncCode, old: torch.Tensor, new: torch.Tensor,
               maps: tuple[torch.Tensor, torch.Tensor], weights: list, group: Any,
               nodes: int) -> SimpleNamespace:
    """One rank's `EplbState` stand-in (module doc), its weights `[L][W]` holding `old [L, P]`,
    its maps (`committed`, copied) those of `old`, asked to rebalance to `new [L, P]`."""
    L, P = old.shape
    log2phy, counts = maps
    num_experts = counts.shape[1]
    stats = SimpleNamespace(global_expert_load_window=torch.zeros(1, L, num_experts),
                            num_replicas=P, num_groups=1, num_nodes=nodes,
                            num_gpus=group.size())
    model = SimpleNamespace(
        model=SimpleNamespace(num_moe_layers=L, expert_weights=weights),
        model_name="eplbsim", physical_to_logical_map=old.clone(),
        logical_to_physical_map=log2phy.clone(), logical_replica_count=counts.clone(),
        expert_buffer=[torch.empty_like(t) for t in weights[0]],
        communicator=loaded.comm.TorchDistNcclEplbCommunicator(group), eplb_stats=stats,
        rebalanced=True, pending_result=None)
    policy = SimpleNamespace(rebalance_experts=lambda *args, **kwargs: new.clone())
    config = SimpleNamespace(eplb_config=SimpleNamespace(migration_batching_enabled=False),
                             enable_fault_tolerance=False)
    return SimpleNamespace(model_states={"eplbsim": model}, is_async=True, policy=policy,
                           parallel_config=config, ft_reset_epoch=0, device_index=None,
                           rearrange_event=_Trigger(), async_worker_error=None)


def work(loaded: AsyncCode, state: SimpleNamespace) -> None:
    """The rank's async worker until its rearrangement is done (`transfer_run_periodically`,
    ended by `Done`)."""
    try:
        loaded.worker.transfer_run_periodically(state=state, stream=torch.Stream(device="cpu"))
    except Done:
        pass


@contextmanager
def stand_ins(loaded: AsyncCode, group: Any) -> Iterator[None]:
    """The accelerator and the EP group as the module doc says, during the block."""
    eplb_group = SimpleNamespace(device_group=group, cpu_group=group)
    cpu = torch.Stream(device="cpu")
    with patched([(torch, "Event", _InOrderEvent),
                  (torch.accelerator, "current_stream", lambda *args: cpu),
                  (torch.accelerator, "set_stream", lambda stream: None),
                  (loaded.worker, "get_eplb_group", lambda: eplb_group)]):
        yield
