"""What SGLang's EPLB code reads of its runtime, in every shape a release has read it
(DESIGN.md §11, "Every release"): one settings object and the modules that hand it out.

Where the settings come from moves between releases (seen in the wheels):
- a flat `ServerArgs`: `server_args.X` passed in (0.5.16 `init_by_mapping(server_args, ...)`);
- `server_args.get_global_server_args().X` (0.5.14);
- `runtime_context.get_server_args().X` (0.5.16);
- `runtime_context.get_exec().moe.X`, `get_parallel().X`, `get_device().device` and
  `get_resources().X` (0.5.17 and later);
- `managers.schedule_batch.global_server_args_dict["X"]` (0.4 releases).

`Settings` answers all of them: its flat fields are ServerArgs' names, and `moe`, `parallel`,
`resources` are the object itself, so `get_exec().moe.ep_size` and `server_args.ep_size` read
the same field. A setting eplbsim does not supply is an error naming it
(`MissingSetting`, an `AttributeError` too, so the engine's own `getattr(x, name, default)` still
takes its default). `modules(settings)` are the runtime modules, for `source.Modules`' stubs.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any, Iterator

from ..errors import InputError

A2A_BACKEND = "deepep"  # any backend but "none" turns on per-rank narrowing and randint


class MissingSetting(InputError, AttributeError):
    """An engine setting eplbsim does not supply."""


class Settings:
    """The deployment as SGLang's settings say it (module doc). Fields (ServerArgs' names):
    `ep_dispatch_algorithm`, `moe_a2a_backend`, `ep_num_redundant_experts`, `eplb_algorithm`,
    `init_expert_location`, `enable_eplb`, `ep_join_mode`; `ep_size`, `tp_size`, `nnodes`,
    `elastic_ep_initial_size`, `ep_join_rank_offset`, `moe_ep_group`; `device`; and the
    resources `expert_location_metadata` (the global metadata) and `lplb_solvers`."""

    def __init__(self, label: str) -> None:
        self._label = label
        self.ep_dispatch_algorithm: str | None = "dynamic"
        self.moe_a2a_backend = "none"
        self.ep_num_redundant_experts = 0
        self.eplb_algorithm = "deepseek"
        self.init_expert_location = "trivial"
        self.enable_eplb = False
        self.ep_join_mode = None
        self.ep_size = self.tp_size = self.nnodes = 1
        self.elastic_ep_initial_size = None
        self.ep_join_rank_offset = 0
        self.moe_ep_group: Any = None
        self.device = "cpu"
        self.expert_location_metadata: Any = None
        self.lplb_solvers: dict = {}

    @property
    def moe(self) -> "Settings":
        return self

    @property
    def parallel(self) -> "Settings":
        return self

    @property
    def resources(self) -> "Settings":
        return self

    @property
    def enable_deepep_moe(self) -> bool:
        """The 0.4 releases' flag for what `moe_a2a_backend` says now."""
        return self.moe_a2a_backend != "none"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise MissingSetting(f"{self.__dict__.get('_label', 'the engine')} read the setting "
                             f"{name!r}, which eplbsim does not supply")

    def as_dict(self) -> "SettingsDict":
        return SettingsDict(self)


class SettingsDict(Mapping):
    """`global_server_args_dict`: the settings read by key."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings

    def __getitem__(self, key: str) -> Any:
        try:
            return getattr(self._settings, key)
        except MissingSetting as exc:
            raise KeyError(str(exc)) from None

    def __iter__(self) -> Iterator[str]:
        return (k for k in vars(self._settings) if not k.startswith("_"))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def modules(settings: Settings) -> dict[str, ModuleType]:
    """The modules every release has read its settings from, each answering with `settings`."""
    runtime = ModuleType("sglang.srt.runtime_context")
    for getter in ("get_exec", "get_parallel", "get_device", "get_resources", "get_server_args"):
        setattr(runtime, getter, lambda: settings)
    server_args = ModuleType("sglang.srt.server_args")
    server_args.get_global_server_args = lambda: settings
    server_args.ServerArgs = Settings
    batch = ModuleType("sglang.srt.managers.schedule_batch")
    batch.global_server_args_dict = settings.as_dict()
    return {m.__name__: m for m in (runtime, server_args, batch)}


__all__ = ["A2A_BACKEND", "MissingSetting", "Settings", "modules"]
