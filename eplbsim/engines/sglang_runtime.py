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
`resources` (and `_resolved()`, the view ServerArgs' own checks read from 0.5.17) are the object
itself, so `get_exec().moe.ep_size` and `server_args.ep_size` read the same field. A setting eplbsim does not supply is an error naming it
(`MissingSetting`, an `AttributeError` too, so the engine's own `getattr(x, name, default)` still
takes its default). `modules(settings)` are the runtime modules, for `source.Modules`' stubs.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from types import ModuleType
from typing import Any, Iterator

from ..base.errors import InputError
from . import identity

A2A_BACKEND = "deepep"  # any backend but "none" turns on per-rank narrowing and randint


class MissingSetting(InputError, AttributeError):
    """An engine setting eplbsim does not supply."""


class Settings:
    """The deployment as SGLang's settings say it (module doc). Fields (ServerArgs' names):
    `ep_dispatch_algorithm`, `moe_a2a_backend`, `ep_num_redundant_experts`, `eplb_algorithm`,
    `init_expert_location`, `enable_eplb`, `ep_join_mode`; `ep_size`, `tp_size`, `nnodes`,
    `elastic_ep_initial_size`, `ep_join_rank_offset`; `device`; the resources
    `expert_location_metadata` (the global metadata) and `lplb_solvers`; and the rank's own
    place, answered per simulated rank (`identity.SGLANG_FIELDS`, and each group handle
    `NAME_group`, `identity.SGLANG_GROUPS`)."""

    def __init__(self, label: str) -> None:
        self._label = label
        self.ep_dispatch_algorithm: str | None = "dynamic"
        self.moe_a2a_backend = "none"
        self.ep_num_redundant_experts = 0
        self.eplb_algorithm = "deepseek"
        self.init_expert_location = "trivial"
        self.enable_eplb = False
        self.expert_distribution_recorder_mode: str | None = None
        self.ep_join_mode = None
        self.ep_size = self.tp_size = self.nnodes = 1
        self.elastic_ep_initial_size = None
        self.ep_join_rank_offset = 0
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

    def _resolved(self) -> "Settings":
        return self

    @property
    def enable_deepep_moe(self) -> bool:
        """The 0.4 releases' flag for what `moe_a2a_backend` says now."""
        return self.moe_a2a_backend != "none"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in identity.SGLANG_FIELDS:  # the rank's place, answered per simulated rank
            return identity.answer(f"sglang get_parallel().{name}", identity.SGLANG_FIELDS[name])
        group = name[:-len("_group")] if name.endswith("_group") else None
        if group in identity.SGLANG_GROUPS:
            return identity.Group("sglang", group)
        flag = next((f for f, (field, _) in FLAGS.items() if field == name), None)
        can = (f"give it with --engine-args {flag} (sglang:auto)" if flag else
               "it is a setting of the serving stack a simulation does not model: read it "
               "with getattr(..., default) in the branch, or ask for it in an eplbsim issue "
               "naming the setting")
        raise MissingSetting(f"{self.__dict__.get('_label', 'the engine')} read the setting "
                             f"{name!r} at {identity.reader()}, which eplbsim does not "
                             f"supply; {can}")

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


# The SGLang server flags `--engine-args` may give (`sglang:auto`): flag -> (field, type);
# `bool` for a switch. The rest of a deployment is the run's: GPUs, slots, mode.
FLAGS = {"--enable-eplb": ("enable_eplb", bool),
         "--moe-a2a-backend": ("moe_a2a_backend", str),
         "--ep-dispatch-algorithm": ("ep_dispatch_algorithm", str),
         "--init-expert-location": ("init_expert_location", str),
         "--eplb-algorithm": ("eplb_algorithm", str),
         "--ep-num-redundant-experts": ("ep_num_redundant_experts", int),
         "--ep-size": ("ep_size", int), "--ep": ("ep_size", int)}


def flags(text: str) -> dict[str, Any]:
    """The settings SGLang server flags `text` give (`FLAGS`: `--flag VALUE`, `--flag=VALUE`,
    a switch alone), by field name. InputError, in one line, for a flag not in `FLAGS`, a
    switch given a value or a value that is not of the flag's type."""
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise InputError(f"--engine-args {text!r}: {exc}") from None
    out: dict[str, Any] = {}
    i = 0
    while i < len(words):
        flag, eq, value = words[i].partition("=")
        if flag not in FLAGS:
            raise InputError(f"--engine-args: eplbsim reads the SGLang flags "
                             f"{', '.join(FLAGS)}; {words[i]!r} is not one of them")
        field, kind = FLAGS[flag]
        if kind is bool:
            if eq:
                raise InputError(f"--engine-args: {flag} is a switch, given {value!r}")
            out[field] = True
            i += 1
            continue
        if not eq:
            if i + 1 >= len(words) or words[i + 1].startswith("--"):
                raise InputError(f"--engine-args: {flag} needs a value")
            value, i = words[i + 1], i + 1
        try:
            out[field] = kind(value)
        except ValueError:
            raise InputError(f"--engine-args: {flag} takes {kind.__name__}, got {value!r}") \
                from None
        i += 1
    return out


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


__all__ = ["A2A_BACKEND", "FLAGS", "MissingSetting", "Settings", "flags", "modules"]
