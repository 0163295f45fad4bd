"""Every model eplbsim knows, and the model a run prices (DESIGN.md §5, §8).

A model is given as a name or as a Hugging Face `config.json` (`configs`): a path to the file,
or to a folder holding one. Names are the built-in `shapes.MODELS` and, when NVIDIA's
aiconfigurator-core (an optional extra) is installed, every config it ships
(`Qwen/Qwen3-30B-A3B`, read from its `model_configs/` folder, not imported). A name is case and
suffix tolerant (`model_named`). A trace's meta names its model under any of
`traces.trace.MODEL_KEYS`; a model that is not known, or that differs from the trace in experts
or top-k, is never priced without a word (`trace_model`, `model_note`).
"""

from __future__ import annotations

import difflib
import importlib.util
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..base.errors import InputError
from ..base.options import option
from ..traces.trace import model_in
from .configs import config_shape
from .shapes import DEFAULT_MODEL, MODELS, ModelShape

SUFFIX_BREAKS = "-_.:"  # what may follow a known model's name in a longer one (`-Chat`, `-0324`)
SHIPPED_PACKAGE = "aiconfigurator_core"
NAME_FORMS = "--model NAME|config.json"  # how a user names the model to price


@lru_cache(maxsize=1)
def shipped() -> dict[str, Path]:
    """`{Hugging Face id: config file}` of every config aiconfigurator-core ships
    (`ORG--NAME_config.json`), empty when it is not installed."""
    spec = importlib.util.find_spec(SHIPPED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return {}
    folder = Path(next(iter(spec.submodule_search_locations))) / "model_configs"
    files = sorted(folder.glob("*_config.json")) if folder.is_dir() else []
    return {p.name[:-len("_config.json")].replace("--", "/", 1): p for p in files
            if not p.name.endswith("_hf_quant_config.json")}


def _tail(name: str) -> str:
    """The part of a name after its last `/`, lower case, `_` and spaces read as `-`."""
    return name.strip().rsplit("/", 1)[-1].lower().replace("_", "-").replace(" ", "-")


def model_named(name: object) -> str | None:
    """The known model a name denotes (a `MODELS` key or a shipped config's id), or None: the
    name's tail (`_tail`) is a built-in key, else a shipped id's tail (or the whole id, case
    aside), else it starts with a known tail followed by `-`, `_`, `.` or `:` (the longest:
    `Qwen/Qwen1.5-MoE-A2.7B-Chat` is `qwen1.5-moe-a2.7b`)."""
    if not isinstance(name, str) or not name.strip():
        return None
    text = _tail(name)
    if text in MODELS:
        return text
    ids = shipped()
    exact = [i for i in ids if i.lower() == name.strip().lower()] or \
        [i for i in ids if _tail(i) == text]
    if exact:
        return exact[0]
    tails = {**{_tail(i): i for i in ids}, **{key: key for key in MODELS}}
    known = [t for t in tails if text.startswith(t) and text[len(t)] in SUFFIX_BREAKS]
    return tails[max(known, key=len)] if known else None


def closest(name: str, n: int = 3) -> list[str]:
    """The known models whose names are closest to `name` (`difflib`)."""
    names = {_tail(k): k for k in [*shipped(), *MODELS]}
    return [names[t] for t in difflib.get_close_matches(_tail(name), names, n=n, cutoff=0.5)]


def config_path(value: object) -> Path | None:
    """The config file `value` points to (a `.json` path, or a folder holding `config.json`),
    or None when it is a name."""
    if not isinstance(value, (str, os.PathLike)):
        return None
    path = Path(value)
    if str(value).lower().endswith(".json"):
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json"
    return None


def model_shape(value: Any) -> ModelShape:
    """The shape of a model given as a `ModelShape`, a config path (`config_path`) or a name
    (`model_named`); InputError naming the closest known models for an unknown name, or the
    key and file for a config that does not describe an MoE model the cost model can price."""
    if isinstance(value, ModelShape):
        return value
    path = config_path(value)
    if path is not None:
        stat = os.stat(path) if path.is_file() else None
        return _config(str(path), stat and (stat.st_mtime_ns, stat.st_size))
    key = model_named(value)
    if key is None:
        near = closest(str(value))
        raise InputError(f"unknown model {value!r}"
                         + (f" (did you mean {' or '.join(near)}?)" if near else "")
                         + f"; give a known name (eplbsim models lists them) or the path of "
                           f"its Hugging Face config.json")
    if key in MODELS:
        return MODELS[key]
    file = shipped()[key]
    return _config(str(file), None, f"aiconfigurator-core model_configs/{file.name}")


@lru_cache(maxsize=256)
def _config(path: str, stamp: Any, source: str = "") -> ModelShape:
    """`configs.config_shape`, read again when the file's `stamp` (mtime, size) changes."""
    return config_shape(path, source)


def model_label(value: Any) -> str:
    """How a header names a model: its known name, the config path as given, or "a given
    shape" for a `ModelShape`."""
    if isinstance(value, ModelShape):
        return "a given shape"
    if config_path(value) is not None:
        return str(value)
    return model_named(value) or str(value)


def differs(shape: ModelShape, experts: int, top_k: int | None) -> bool:
    """Whether `shape`'s experts or top-k differ from a trace's (`top_k` None: counts only,
    no top-k to compare)."""
    return shape.experts != experts or top_k not in (None, shape.top_k)


def trace_model(meta: dict, experts: int, top_k: int | None) -> str:
    """The model a trace of `experts` experts and `top_k` (None: counts only) is priced as
    when none is given: the known one its meta names (`traces.trace.model_in`), else
    `DEFAULT_MODEL` (the header says so, `model_note`). InputError when the named model's
    experts or top-k differ from the trace's, saying how to read or price it."""
    given = model_in(meta)
    named = model_named(given)
    if named is None:
        return DEFAULT_MODEL
    shape = model_shape(named)
    if differs(shape, experts, top_k):
        fewer = experts < shape.experts and top_k in (None, shape.top_k)
        raise InputError(f"the trace's meta names model {given!r} ({named}: "
                         f"{shape.experts} experts, top-{shape.top_k}), but the trace has "
                         f"{experts} experts" + (f", top-{top_k}" if top_k else "") + ": "
                         + (f"read it with --experts {shape.experts} if its ids never reach "
                            f"the last experts, or " if fewer else "")
                         + f"name the model to price it as with --model (--model {named} "
                         f"prices it so anyway)")
    return named


def model_origin(meta: dict, given: bool) -> str:
    """Where a run's model came from: "given" (by flag or spec), the trace's meta, or the
    default (naming the closest known models to an unknown name)."""
    if given:
        return "given"
    named = model_in(meta)
    if model_named(named) is not None:
        return f"named by the trace's meta: {named!r}"
    if named is None:
        return "the default: the trace names no model"
    near = closest(named)
    return (f"the default: the trace names {named!r}, which eplbsim does not know"
            + (f" (closest: {', '.join(near)})" if near else ""))


def model_note(label: str, shape: ModelShape, origin: str, experts: int,
               top_k: int | None) -> str | None:
    """One line for the header when the model priced (`label`, `shape`, from `origin`) is
    the default the trace did not choose, or differs from the trace's `experts` or `top_k`;
    else None."""
    other = differs(shape, experts, top_k)
    default = origin.startswith("the default")
    if not other and not (default and "does not know" in origin):
        return None
    words = f"model {label} ({origin})"
    if other:
        words += (f" has {shape.experts} experts, top-{shape.top_k}; the trace has E={experts}"
                  + (f", K={top_k}" if top_k else "") + ": its loads are priced as that "
                  "model's")
    else:
        words += " is priced"
    return words + (f"; name the model with {option('model', 'NAME')}|config.json"
                    if default else "")


def _draft_words(shape: ModelShape) -> str:
    """A shape's draft (MTP) layers as `model_rows` shows them: "N", or "NxE/K" when the draft
    has experts or a top-k of its own."""
    if not (shape.draft_experts or shape.draft_top_k):
        return str(shape.draft_layers)
    return (f"{shape.draft_layers}x{shape.draft_experts or shape.experts}/"
            f"{shape.draft_top_k or shape.top_k}")


def model_rows() -> list[dict[str, Any]]:
    """Every known model (the built-in ones, then aiconfigurator-core's MoE configs) as
    `name`, `experts`, `top_k`, `moe_layers`, `layers` (0: not stated), `hidden`,
    `intermediate`, `shared` ("NxI"), `dtype` (the experts' weights), `hash_layers` (the first
    layers, routed by token id), `draft` (draft layers, "NxE/K" where the draft has its own
    experts) and `source`; a shipped config that is not an MoE model is left out."""
    rows = []
    for name in [*MODELS, *shipped()]:
        try:
            s = model_shape(name) if name in MODELS else model_shape(str(shipped()[name]))
        except InputError:
            continue
        source = s.source if name in MODELS else \
            f"aiconfigurator-core model_configs/{shipped()[name].name}"
        rows.append({"name": name, "experts": s.experts, "top_k": s.top_k,
                     "moe_layers": s.moe_layers, "layers": s.layers, "hidden": s.hidden,
                     "intermediate": s.intermediate,
                     "shared": f"{s.shared_experts}x{s.shared_intermediate}"
                     if s.shared_experts else "0", "dtype": s.weight_dtype,
                     "hash_layers": s.hash_layers, "draft": _draft_words(s), "source": source})
    return rows
