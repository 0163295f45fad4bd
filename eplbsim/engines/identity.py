"""A simulated rank is that rank to every channel its engine code can ask (DESIGN.md §11).

Dimensions: `G` ranks (EP = GPUs), `N` nodes.

An engine's EPLB code learns which rank it runs on through several channels, and a branch may
use any of them. During rank `r`'s call into an engine's code (`as_rank`), every channel in
`CHANNELS` answers `r`'s identity (`Identity`): the rank, its place on its node and in each
parallel group of the simulated deployment (EP over all `G` ranks; attention tensor-parallel
over `tp` ranks and data-parallel over `G / tp`; no pipeline, no MoE TP or DP). Each answer that
tells the rank apart is noted (`dispatch.observe.note`), with the engine file and line that
asked, so a probe knows the call reads its rank and runs it once a rank. A rank read answered
"0" on every rank, or left unanswered, would turn the seed's bug into a pass.

The channels, as the releases eplbsim fetches and their main branches read them:
- `torch.distributed` (`TORCH_FUNCTIONS`): `is_initialized()` true, `get_rank`,
  `get_world_size`, `get_process_group_ranks`, `get_group_rank`, `get_global_rank`,
  `get_node_local_rank` (SGLang's `expert_location.py` reads `get_rank()` for `static`'s tables,
  its `eplb_manager.py` and `expert_distribution.py` too). Wrapped once, for good, in the
  `torch.distributed` module and wherever an engine module imported them by name: a wrapper
  answers only an engine's frame on a thread inside `as_rank`, and is the function it wraps for
  everyone else.
- the environment (`ENVIRONMENT`): `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`,
  `GROUP_RANK`, `NODE_RANK`, read through `os.environ` or `os.getenv` (torchrun's names).
- the device index (`DEVICE_FUNCTIONS`): `torch.cuda.current_device()` and
  `torch.accelerator.current_device_index()` answer the rank's local index on its node.
- SGLang's parallel state (`SGLANG_FIELDS`, `SGLANG_GETTERS`): `get_parallel()` fields
  (`tp_rank`, `moe_ep_rank`, `attn_tp_rank`, `attn_dp_rank`, `dp_rank`, ... and the group
  handles), the server args of older releases, and the `get_*_parallel_rank()` getters of
  `sglang.srt.distributed` and `sglang.srt.layers.dp_attention`.
- vLLM's parallel state (`VLLM_GETTERS`): `get_ep_group()`, `get_tp_group()`, `get_dp_group()`,
  `get_pp_group()`, `get_world_group()` (each a `Group` with `rank`, `rank_in_group`,
  `world_size`, `ranks`, `local_rank`) and `get_tensor_model_parallel_rank()` and kin.

A channel nobody listed is still caught when it changes the choice: the probe runs the call as
two ranks on equal inputs and compares the outputs (`dispatch.observe`). An exception raised
inside the engine's code leaves `as_rank` as an `EngineError` naming the engine, its source, the
rank, the function and the engine file and line of the raising frame.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from collections.abc import MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..base.errors import InputError
from ..dispatch.observe import note, watching


class EngineError(InputError):
    """An exception raised inside an engine's own code: the engine's, not eplbsim's (its
    message names the engine, the source, the rank, the function, and the file and line).
    `label` is the source's label (`engines.label`)."""

    def __init__(self, message: str, label: str) -> None:
        super().__init__(message)
        self.label = label


@dataclass(frozen=True)
class Identity:
    """Rank `rank` of `world` EP ranks over `nodes` nodes, attention tensor-parallel over `tp`
    consecutive ranks (module doc)."""

    rank: int
    world: int
    nodes: int = 1
    tp: int = 1

    @property
    def local_world(self) -> int:
        return max(self.world // max(self.nodes, 1), 1)

    def value(self, field: str) -> int:
        """The value of identity field `field` (`FIELDS`) for this rank."""
        return FIELDS[field][0](self)


# field -> (its value for an identity, whether it tells ranks apart: a rank read)
FIELDS: dict[str, tuple[Callable[[Identity], int], bool]] = {
    "rank": (lambda i: i.rank, True),
    "world_size": (lambda i: i.world, False),
    "local_rank": (lambda i: i.rank % i.local_world, True),
    "local_world_size": (lambda i: i.local_world, False),
    "node_rank": (lambda i: i.rank // i.local_world, True),
    "nnodes": (lambda i: i.nodes, False),
    "attn_tp_rank": (lambda i: i.rank % i.tp, True),
    "attn_tp_size": (lambda i: i.tp, False),
    "attn_dp_rank": (lambda i: i.rank // i.tp, True),
    "attn_dp_size": (lambda i: max(i.world // i.tp, 1), False),
    "zero": (lambda i: 0, True),  # a group of one rank a rank (pipeline, MoE TP and DP, CP):
    # the same answer everywhere, but still the rank's own place
    "one": (lambda i: 1, False),
}

TORCH_FUNCTIONS = {  # torch.distributed function -> the field it answers
    "get_rank": "rank", "get_world_size": "world_size", "get_node_local_rank": "local_rank"}
ENVIRONMENT = {"RANK": "rank", "LOCAL_RANK": "local_rank", "WORLD_SIZE": "world_size",
               "LOCAL_WORLD_SIZE": "local_world_size", "GROUP_RANK": "node_rank",
               "NODE_RANK": "node_rank"}
DEVICE_FUNCTIONS = {("cuda", "current_device"): "local_rank",
                    ("accelerator", "current_device_index"): "local_rank"}
GROUPS = {  # a parallel group -> (rank in it, its size): EP and TP span every rank
    "world": ("rank", "world_size"), "tp": ("rank", "world_size"),
    "moe_ep": ("rank", "world_size"), "ep": ("rank", "world_size"),
    "eplb": ("rank", "world_size"),  # vLLM's EPLB group: the EP ranks
    "attn_tp": ("attn_tp_rank", "attn_tp_size"), "dp": ("attn_dp_rank", "attn_dp_size"),
    "attn_dp": ("attn_dp_rank", "attn_dp_size"), "pp": ("zero", "one"),
    "moe_tp": ("zero", "one"), "moe_dp": ("zero", "one"), "attn_cp": ("zero", "one"),
    "dcp": ("zero", "one"), "pcp": ("zero", "one"), "moe_cp": ("zero", "one")}
SGLANG_FIELDS = {  # get_parallel() / server_args field -> identity field
    **{f"{g}_rank": r for g, (r, _) in GROUPS.items() if g not in ("world", "eplb")},
    **{f"{g}_size": s for g, (_, s) in GROUPS.items() if g not in ("world", "tp", "ep", "eplb")},
    "dp_size": "attn_dp_size", "node_rank": "node_rank", "launch_world_rank": "rank",
    "launch_world_size": "world_size", "attn_dcp_rank": "zero"}
SGLANG_GETTERS = {  # sglang.srt.distributed / dp_attention function -> identity field
    "get_world_rank": "rank", "get_world_size": "world_size",
    "get_tensor_model_parallel_rank": "rank", "get_tensor_model_parallel_world_size": "world_size",
    "get_moe_expert_parallel_rank": "rank", "get_moe_expert_parallel_world_size": "world_size",
    "get_moe_tensor_parallel_rank": "zero", "get_moe_tensor_parallel_world_size": "one",
    "get_moe_data_parallel_rank": "zero", "get_moe_data_parallel_world_size": "one",
    "get_pipeline_model_parallel_rank": "zero", "get_pipeline_model_parallel_world_size": "one",
    "get_attn_tensor_model_parallel_rank": "attn_tp_rank",
    "get_attn_tensor_model_parallel_world_size": "attn_tp_size",
    "get_attn_context_model_parallel_rank": "zero",
    "get_attn_context_model_parallel_world_size": "one",
    "get_dcp_rank": "zero", "get_dcp_world_size": "one",
    "get_attention_tp_rank": "attn_tp_rank", "get_attention_tp_size": "attn_tp_size",
    "get_attention_dp_rank": "attn_dp_rank", "get_attention_dp_size": "attn_dp_size",
    "get_local_attention_dp_rank": "attn_dp_rank", "get_local_attention_dp_size": "attn_dp_size",
    "get_attention_cp_rank": "zero", "get_attention_cp_size": "one",
    "get_moe_cp_rank": "zero", "get_moe_cp_size": "one"}
VLLM_GETTERS = {  # vllm.distributed function -> identity field
    "get_tensor_model_parallel_rank": "rank", "get_tensor_model_parallel_world_size": "world_size",
    "get_pipeline_model_parallel_rank": "zero", "get_pipeline_model_parallel_world_size": "one",
    "get_decode_context_model_parallel_rank": "zero",
    "get_decode_context_model_parallel_world_size": "one"}
SGLANG_GROUPS = ("world", "tp", "moe_ep", "moe_tp", "moe_dp", "pp", "attn_tp", "attn_cp",
                 "dcp", "moe_cp")  # get_X_group() in sglang.srt.distributed
VLLM_GROUPS = ("world", "tp", "ep", "eplb", "dp", "pp", "dcp", "pcp")  # get_X_group() in vLLM


def _channels() -> dict[str, str]:
    """Every channel, as the probe names it -> the identity field it answers."""
    out = {f"torch.distributed.{f}": v for f, v in TORCH_FUNCTIONS.items()}
    out.update({f"os.environ[{k!r}]": v for k, v in ENVIRONMENT.items()})
    out.update({f"torch.{m}.{f}": v for (m, f), v in DEVICE_FUNCTIONS.items()})
    out.update({f"sglang get_parallel().{k}": v for k, v in SGLANG_FIELDS.items()})
    out.update({f"sglang {f}": v for f, v in SGLANG_GETTERS.items()})
    out.update({f"sglang get_{g}_group().{a}": GROUPS[g][i] for g in SGLANG_GROUPS
                for a, i in GROUP_ATTRIBUTES.items()})
    out.update({f"vllm {f}": v for f, v in VLLM_GETTERS.items()})
    out.update({f"vllm get_{g}_group().{a}": GROUPS[g][i] for g in VLLM_GROUPS
                for a, i in GROUP_ATTRIBUTES.items()})
    return out


GROUP_ATTRIBUTES = {"rank_in_group": 0, "world_size": 1}  # a group's attribute -> GROUPS index
CHANNELS: dict[str, str] = _channels()  # the one list: channel -> the identity field it answers


# -- whose call runs -----------------------------------------------------------------------

_LOCAL = threading.local()  # .stack: [(identity, root, label)] of this thread's engine calls
_ROOTS: set[str] = set()  # every engine source's folder, as a path prefix


def current() -> tuple[Identity, str, str] | None:
    """The identity, source folder and label of this thread's innermost engine call, or None."""
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


def _engine_frame(depth: int = 16) -> Any:
    """The nearest of the calling frames (up to `depth`) that runs an engine source's file, or
    None."""
    frame = sys._getframe(2)
    while frame is not None and depth:
        name = frame.f_code.co_filename
        if any(name.startswith(root) for root in _ROOTS):
            return frame
        frame, depth = frame.f_back, depth - 1
    return None


def _where(frame: Any, root: str) -> str:
    """`path:line` of an engine frame, the path under its source folder (a file's name when
    the source is one file)."""
    if frame is None:
        return "?"
    return f"{_relative(frame.f_code.co_filename, root)}:{frame.f_lineno}"


def _relative(name: str, root: str) -> str:
    """File `name` as a message names it: under the source folder `root`, or its own name
    when the source is that one file."""
    if not name.startswith(root):
        return name
    return name[len(root):].lstrip(os.sep) if root.endswith(os.sep) else Path(name).name


def answer(channel: str, field: str | None = None) -> int:
    """What `channel` (a `CHANNELS` name) answers on this thread's engine call: its identity
    field's value, noted as a rank read when the field tells ranks apart. InputError when no
    engine call runs (nothing may answer a rank there)."""
    now = current()
    field = field or CHANNELS[channel]
    if now is None:
        raise InputError(f"an engine read its rank through {channel} outside any simulated "
                         f"rank's call: eplbsim cannot answer it (report it)")
    identity, root, _ = now
    if FIELDS[field][1]:
        note(channel, _where(_engine_frame(), root))
    return identity.value(field)


# -- the wrappers --------------------------------------------------------------------------

def _wrap(channel: str, original: Callable, field: str,
          reply: Callable[..., Any] | None = None) -> Callable:
    """`original`, answering `channel` as the rank (`answer`, or `reply(value, *args)`) to a
    line of an engine's file on a thread inside `as_rank`, and as itself to everyone else
    (torch's own code called by the engine included)."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if current() is None or _engine_frame(1) is None:  # asked by the engine's own line
            return original(*args, **kwargs)
        value = answer(channel, field)
        return reply(value, *args, **kwargs) if reply else value
    wrapper.__wrapped__ = original
    wrapper.__name__ = getattr(original, "__name__", channel)
    wrapper._eplbsim_channel = channel
    return wrapper


def _in_group(value: int, group: Any = None, *args: Any, **kwargs: Any) -> int:
    """`get_rank(group)`: a simulated group's own rank when one is given (`Group`, or its
    `ProcessGroup`)."""
    if isinstance(group, ProcessGroup):
        group = group.group
    return group.rank_in_group if isinstance(group, Group) else value


def _torch_wrappers() -> dict[tuple[Any, str], Callable]:
    """(owner, name) -> its wrapper, for every torch function a channel answers."""
    world = lambda i, *a, **k: list(range(current()[0].world))  # noqa: E731
    same = lambda i, *a, **k: [*a, *k.values()][-1]  # noqa: E731 - a rank's number is the
    # same in the world and in the simulated groups that span it
    answers = [(name, field, _in_group if name == "get_rank" else None)
               for name, field in TORCH_FUNCTIONS.items()]
    answers += [("is_initialized", "one", lambda i, *a, **k: True),
                ("is_available", "one", lambda i, *a, **k: True),
                ("get_process_group_ranks", "one", world), ("get_group_rank", "one", same),
                ("get_global_rank", "one", same)]
    out: dict[tuple[Any, str], Callable] = {}
    dist = torch.distributed
    for owner in (dist, getattr(dist, "distributed_c10d", None)):  # where torch defines them
        for name, field, reply in answers:
            if owner is not None and hasattr(owner, name):
                out[(owner, name)] = _wrap(f"torch.distributed.{name}", getattr(owner, name),
                                           field, reply)
    for (module, name), field in DEVICE_FUNCTIONS.items():
        owner = getattr(torch, module, None)
        if owner is not None and hasattr(owner, name):
            out[(owner, name)] = _wrap(f"torch.{module}.{name}", getattr(owner, name), field)
    return out


_INSTALLED: dict[int, Callable] = {}  # id(original) -> its wrapper, once installed
_INSTALL_LOCK = threading.Lock()


def _install() -> None:
    """Wrap the torch channels for good (module doc), once a process."""
    with _INSTALL_LOCK:
        if _INSTALLED:
            return
        for (owner, name), wrapper in _torch_wrappers().items():
            _INSTALLED[id(wrapper.__wrapped__)] = wrapper
            setattr(owner, name, wrapper)


def rewire(scope: dict[str, Any]) -> None:
    """Point the names an engine module (its globals `scope`) imported from the torch channels
    (`from torch.distributed import get_rank`) at their wrappers, as `torch.distributed`'s
    own."""
    _install()
    for key, value in list(scope.items()):
        wrapper = _INSTALLED.get(id(value))
        if wrapper is not None and wrapper is not value and callable(value):
            scope[key] = wrapper


class _Environ(MutableMapping):
    """`os.environ` during engine calls: the rank's `ENVIRONMENT` answered to an engine frame
    of a thread inside `as_rank`, the real environment to everyone else and for every other
    name."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def _mine(self, key: Any) -> bool:
        return key in ENVIRONMENT and current() is not None and _engine_frame() is not None

    def __getitem__(self, key: Any) -> str:
        if self._mine(key):
            return str(answer(f"os.environ[{key!r}]"))
        return self.real[key]

    def __contains__(self, key: Any) -> bool:
        return self._mine(key) or key in self.real

    def __setitem__(self, key: Any, value: Any) -> None:
        self.real[key] = value

    def __delitem__(self, key: Any) -> None:
        del self.real[key]

    def __iter__(self) -> Iterator:
        return iter(self.real)

    def __len__(self) -> int:
        return len(self.real)

    def copy(self) -> dict:
        return dict(self.real)


_ENV_DEPTH = [0]  # engine calls under way in the process (the environment wrapped while > 0)


@contextmanager
def _environment() -> Iterator[None]:
    """`os.environ` watched (`_Environ`) while any thread's engine call runs."""
    with _INSTALL_LOCK:
        if _ENV_DEPTH[0] == 0:
            os.environ = _Environ(os.environ)
        _ENV_DEPTH[0] += 1
    try:
        yield
    finally:
        with _INSTALL_LOCK:
            _ENV_DEPTH[0] -= 1
            if _ENV_DEPTH[0] == 0 and isinstance(os.environ, _Environ):
                os.environ = os.environ.real


class Group:
    """A parallel group of the simulated deployment (`GROUPS`) as the engines' group
    coordinators show it: `rank_in_group`, `world_size` (rank reads noted as
    `ENGINE get_NAME_group().ATTRIBUTE`), `rank` (the global rank), `ranks`, `local_rank`,
    `first_rank`, `last_rank`, `is_first_rank`, `is_last_rank`; and its torch process groups
    `device_group` and `cpu_group` (`ProcessGroup`: `rank()`, `size()`)."""

    def __init__(self, engine: str, name: str) -> None:
        self.engine, self.name = engine, name

    def _field(self, attribute: str) -> int:
        return answer(f"{self.engine} get_{self.name}_group().{attribute}",
                      GROUPS[self.name][GROUP_ATTRIBUTES[attribute]])

    @property
    def rank_in_group(self) -> int:
        return self._field("rank_in_group")

    @property
    def world_size(self) -> int:
        return self._field("world_size")

    @property
    def rank(self) -> int:
        return answer(f"{self.engine} get_{self.name}_group().rank", "rank")

    @property
    def local_rank(self) -> int:
        return answer(f"{self.engine} get_{self.name}_group().local_rank", "local_rank")

    @property
    def ranks(self) -> list[int]:
        size, me = self.world_size, self.rank_in_group  # outside a rank's call: refused
        return [current()[0].rank - me + i for i in range(size)]

    @property
    def first_rank(self) -> int:
        return self.ranks[0]

    @property
    def last_rank(self) -> int:
        return self.ranks[-1]

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def device_group(self) -> "ProcessGroup":
        return ProcessGroup(self)

    cpu_group = device_group

    def __repr__(self) -> str:
        return f"<eplbsim's simulated {self.name} group>"


class ProcessGroup:
    """A simulated group's torch process group, as `group.rank()` and `group.size()` read it
    (noted as its coordinator's `rank_in_group` and `world_size`)."""

    def __init__(self, group: Group) -> None:
        self.group = group

    def rank(self) -> int:
        return self.group.rank_in_group

    def size(self) -> int:
        return self.group.world_size


def getters(engine: str, names: dict[str, str], groups: tuple[str, ...]) -> dict[str, Any]:
    """An engine's parallel-state functions: each of `names` answering its identity field,
    and `get_NAME_group()` for each of `groups` (`Group`)."""
    out: dict[str, Any] = {}
    for name, field in names.items():
        out[name] = lambda name=name, field=field: answer(f"{engine} {name}", field)
    for g in groups:
        group = Group(engine, g)
        out[f"get_{g}_group"] = lambda *args, group=group, **kwargs: group
    return out


# -- one rank's call -----------------------------------------------------------------------

def register(root: Path | str) -> str:
    """Make `root` (an engine source's folder, or a policy's file) one whose frames the
    channels answer; returns it as the path prefix used."""
    path = Path(root).resolve()
    prefix = str(path) if path.is_file() else str(path) + os.sep
    _ROOTS.add(prefix)
    _install()
    return prefix


def file_scope(fn: Callable, file: str, name: str) -> Callable:
    """The policy `fn` of the file `file` (`name`, `path/file.py:function`) as a policy whose
    calls run as the dispatching rank (`as_rank`): what the file's code reads of its rank is
    that rank's, and an exception it raises names the file, line and rank."""
    prefix = register(file)

    def scoped(topk_ids: Any, view: Any, ctx: Any) -> Any:
        topo = view.placement.topology
        with as_rank(Identity(ctx.rank, topo.num_gpus, topo.num_nodes, ctx.tp), prefix,
                     f"policy {name}", getattr(fn, "__name__", name)):
            return fn(topk_ids, view, ctx)
    scoped.__name__ = getattr(fn, "__name__", name)
    return scoped


@contextmanager
def as_rank(identity: Identity, root: str, label: str, function: str = "") -> Iterator[None]:
    """During the block, this thread's engine calls (source folder `root`, as `register`
    gives it, labelled `label`) are `identity`'s: every channel answers it (module doc). An
    exception the engine's code raises leaves as an `EngineError` naming `function`, the
    rank and the raising engine frame; eplbsim's own `InputError`s pass as they are."""
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    stack.append((identity, root, label))
    try:
        with _environment():
            yield
    except InputError:
        raise
    except Exception as exc:
        error = engine_error(exc, identity, root, label, function)
        if error is None:  # raised by eplbsim's own code around the call
            raise
        raise error from exc
    finally:
        stack.pop()


@contextmanager
def for_every_rank(world: int, nodes: int, root: str, label: str, function: str
                   ) -> Iterator[None]:
    """The block's engine call gives what every rank shares (a solver's placement, the
    settings logic's choice): it runs once, as rank 0 of `world` over `nodes` nodes
    (`as_rank`), and InputError when it reads its rank, since each rank would then compute
    its own."""
    with watching() as reads:
        with as_rank(Identity(0, world, nodes), root, label, function):
            yield
    if reads:
        channel, where = reads[0]
        raise InputError(f"{label}: {function} reads its rank through {channel} ({where}); "
                         f"eplbsim runs it once for every rank, as the engine's result is "
                         f"every rank's, so a result that depends on the rank cannot be "
                         f"simulated")


def engine_error(exc: BaseException, identity: Identity | None, root: str, label: str,
                 function: str = "") -> EngineError | None:
    """`exc` as the `EngineError` naming the engine and its source (`label`), the rank,
    `function` and the innermost engine frame of its traceback (file under `root`, line, and
    the line's code); None when no frame of the traceback runs the engine's code."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith(root)]
    if not frames:
        return None
    last = frames[-1]
    where = f"{_relative(last.filename, root)}:{last.lineno}" + (
        f" (`{last.line.strip()}`)" if last.line else "")
    rank = f", rank {identity.rank}" if identity is not None else ""
    text = " ".join(str(exc).split()) or type(exc).__name__
    whose = "its" if label.startswith("policy ") else "the engine's"
    return EngineError(f"{label}{rank}: {whose} code raised in {function or last.name} at "
                       f"{where}: {type(exc).__name__}: {text}", label)


def reader() -> str:
    """`path:line` of the engine frame nearest the caller's caller (the code that reads
    something eplbsim answers), or "an engine frame" when none is found."""
    frame = _engine_frame()
    if frame is None:
        return "an engine frame"
    name = frame.f_code.co_filename
    root = next((r for r in _ROOTS if name.startswith(r)), "")
    return _where(frame, root)


__all__ = ["CHANNELS", "ENVIRONMENT", "EngineError", "FIELDS", "GROUPS", "Group", "Identity",
           "ProcessGroup", "SGLANG_FIELDS", "SGLANG_GETTERS", "SGLANG_GROUPS", "VLLM_GETTERS",
           "VLLM_GROUPS", "answer", "as_rank", "current", "engine_error", "file_scope",
           "for_every_rank", "getters", "reader", "register", "rewire"]
