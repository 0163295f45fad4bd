"""Choosing a trace's steps: ranges and lists, and the steps that are not serving traffic.

Dimensions: `S` steps, `T_s` tokens of step `s`, `L` layers, `K` top-k, `E` logical experts.

Real logs hold steps that no placement should be solved from (`flag_steps` finds them; a row
is one token's ids over every layer, `[L, K]`, compared exactly):

- **dummy**: a data-parallel rank with no requests of its own runs padding batches to stay in
  step with the other ranks, and these route the same few rows again and again. A step is
  dummy when its ids equal those of another step of the trace entirely (the same rows in the
  same order; equal 128-bit digests of their ids), which real traffic never does (its tokens,
  positions and context differ); or when it has as many rows as such a repeated step (the
  padding batch's size) and one of its rows equals a row of another step (a stale row of the
  padding buffer, routed again).
- **warm-up**: an engine's start-up profiling pass (vLLM runs one of `max_num_batched_tokens`
  dummy tokens) routes every row alike: a step of two or more rows whose ids are all
  identical. Also the steps before the trace's first dummy step, when there are at most
  `WARMUP_LEAD` of them and real traffic (a step neither dummy nor warm-up) follows that dummy
  step: a start-up request (a benchmark's test prompt) run before the rank idled and the load
  began.
- **size outlier**: more than `OUTLIER_FACTOR` times the median tokens of the steps that are
  neither dummy nor warm-up (of every step when all are), `outlier_median` (a warm-up pass
  usually is one too, and so may a legitimate burst).

`trace info` shows which steps are flagged and why.

A selection is text: comma-separated step numbers and Python-style ranges of the original
trace (`0:100`, `200`, `5:`, `:-10`); steps it names that the trace lacks are an error, not
silently dropped. `select(trace, ...)` returns a trace of the kept steps in their order: the same
read interface (`StepView` for token traces, a new `CountsTrace` for counts), with
`meta["steps"]` recording what was kept and dropped.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..base.errors import InputError
from .counts import CountsTrace
from ..base.options import option
from .prefill_chunks import chunk_steps, describe_chunks
from .trace import View, shape_words

OUTLIER_FACTOR = 8  # a step with more than this many times the median tokens is an outlier
WARMUP_LEAD = 2  # at most this many steps before the first dummy step are start-up warm-up
FLAGS = ("warmup", "dummy", "outlier")  # the kinds of flagged steps, as `flag_steps` names them


def parse_steps(text: str, num_steps: int | None = None) -> list[int]:
    """The steps a selection names, in order, without repeats: `"0:4,9"` -> `[0, 1, 2, 3, 9]`.
    Without `num_steps` only the syntax is checked (ranges open at the end are kept open and
    nothing is returned for them); InputError for bad text or a step outside the trace."""
    if not isinstance(text, str) or not text.strip():
        raise InputError(f"a step selection is comma-separated steps and ranges such as "
                         f"0:100,150, got {text!r}")
    out: dict[int, None] = {}
    for item in (s.strip() for s in text.split(",")):
        parts = item.split(":")
        try:
            numbers = [int(p) if p.strip() else None for p in parts]
        except ValueError:
            numbers = None
        if not item or numbers is None or len(parts) > 2 or (len(parts) == 1
                                                             and numbers[0] is None):
            raise InputError(f"step selection {text!r}: {item!r} is not a step (12) or a range "
                             f"(10:20, 10:, :20)")
        if num_steps is None:
            continue
        if len(parts) == 1:
            step = numbers[0] + num_steps if numbers[0] < 0 else numbers[0]
            if not 0 <= step < num_steps:
                raise InputError(f"step selection {text!r}: step {numbers[0]} is outside the "
                                 f"trace's {num_steps} steps")
            out[step] = None
            continue
        picked = range(num_steps)[slice(*numbers)]
        if not len(picked):
            raise InputError(f"step selection {text!r}: {item} selects none of the trace's "
                             f"{num_steps} steps")
        out.update(dict.fromkeys(picked))
    return list(out)


def _identical_rows(ids: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """bool `[S]`: steps of two or more rows whose ids `[sum T_s, L, K]` are all the same
    (`offsets [S + 1]` relative to the first row of `ids`)."""
    rows = ids.reshape(ids.shape[0], -1)
    same = np.concatenate([[True], (rows[1:] == rows[:-1]).all(1)])  # row equals the one before
    breaks = np.cumsum(~same)  # [N] changes so far: none within a step of identical rows
    lo, hi = offsets[:-1], offsets[1:]
    big = hi - lo >= 2
    out = np.zeros(len(lo), dtype=bool)
    out[big] = breaks[hi[big] - 1] == breaks[lo[big]]
    return out


def _id_chunks(trace: Any) -> Any:
    """`(s, e, ids)` for consecutive chunks of whole steps `[s, e)` of about a million ids:
    their stored ids `[sum T, L, K]`, read together (directories larger than memory)."""
    offsets = trace.step_offsets.numpy()
    S, s = trace.num_steps, 0
    while s < S:
        e = s + 1
        while e < S and (offsets[e + 1] - offsets[s]) * trace.num_layers * trace.top_k < 2**20:
            e += 1
        yield s, e, np.concatenate([trace.stored_step(t).numpy() for t in range(s, e)])
        s = e


def _stale_rows(trace: Any, candidates: list[int]) -> list[int]:
    """Those of `candidates` (steps) one of whose rows equals a row of another step."""
    rows: dict[bytes, set[int]] = {}  # a candidate's row -> the candidates holding it
    for s in candidates:
        for row in trace.stored_step(s).numpy():
            rows.setdefault(row.tobytes(), set()).add(s)
    found: set[int] = set()
    offsets = trace.step_offsets.numpy()
    for lo, _, ids in _id_chunks(trace):
        for i, row in enumerate(ids):
            holders = rows.get(row.tobytes())
            if holders:
                step = int(np.searchsorted(offsets, offsets[lo] + i, side="right")) - 1
                found |= holders - {step}
    return sorted(found)


def outlier_median(tokens: np.ndarray, flags: dict[str, list[int]]) -> float:
    """The median tokens a step that a size outlier exceeds `OUTLIER_FACTOR`-fold: of the steps
    (tokens int64 `[S]`) not flagged warm-up or dummy in `flags`, or of all when none is left."""
    gone = set(flags.get("warmup", ())) | set(flags.get("dummy", ()))
    kept = np.delete(tokens, sorted(gone)) if len(gone) < len(tokens) else tokens
    return float(np.median(kept))


def flag_steps(trace: Any) -> dict[str, list[int]]:
    """The flagged steps of a token trace (module doc): `{"warmup": [...], "dummy": [...],
    "outlier": [...]}`, ascending. Reads the ids a chunk of steps at a time (directories larger
    than memory), twice when some step may hold a stale padding row."""
    tokens = trace.tokens_per_step.numpy()
    offsets = trace.step_offsets.numpy()
    alike, digests = [], []
    for s, e, ids in _id_chunks(trace):
        local = offsets[s:e + 1] - offsets[s]
        alike += (np.flatnonzero(_identical_rows(ids, local)) + s).tolist()
        digests += [(int(local[i + 1] - local[i]),
                     hashlib.blake2b(ids[local[i]:local[i + 1]].tobytes(), digest_size=16)
                     .digest()) for i in range(e - s)]
    seen: dict[tuple[int, bytes], int] = {}
    for d in digests:
        seen[d] = seen.get(d, 0) + 1
    repeated = {s for s, d in enumerate(digests) if seen[d] > 1 and d[0] > 0}
    sizes = {int(tokens[s]) for s in repeated}
    candidates = [s for s in range(len(digests)) if s not in repeated and tokens[s] in sizes]
    dummy = sorted(repeated | set(_stale_rows(trace, candidates) if candidates else ()))
    warm = set(alike)
    if dummy:
        lead = [s for s in range(dummy[0]) if s not in warm]
        real = [s for s in range(dummy[0] + 1, len(tokens))
                if s not in warm and s not in set(dummy)]
        if 0 < len(lead) <= WARMUP_LEAD and real:
            warm |= set(lead)
    flags = {"warmup": sorted(warm), "dummy": dummy}
    median = outlier_median(tokens, flags)
    flags["outlier"] = np.flatnonzero(tokens > OUTLIER_FACTOR * max(median, 1.0)).tolist()
    return flags


FLAG_WORDS = {"warmup": ("warm-up step", "drop_warmup"),
              "dummy": ("dummy (data-parallel padding) step", "drop_dummy"),
              "outlier": ("size-outlier step", "drop_outliers")}  # kind: (what, the option)


def flag_words(flags: dict[str, list[int]], lo: int, hi: int,
               names: Sequence[str] | None = None) -> str:
    """What `flags` (`flag_steps`) holds within steps `[lo, hi)`, with the flags that leave
    them out, as the caller names them (`options.option`): "1 flagged warm-up step (0):
    --drop-warmup leaves them out" (`drop_warmup=True` in Python); "" for none.
    `names`: each step's name as the log counts it (`log_steps`), which the words use, as
    `trace info` and `--select-steps` do; default its index."""
    parts, fixes = [], []
    for kind, steps in flags.items():
        inside = [s for s in steps if lo <= s < hi]
        if inside:
            named = [s if names is None else names[s] for s in inside]
            shown = ", ".join(map(str, named[:6])) + (", ..." if len(inside) > 6 else "")
            what, fix = FLAG_WORDS[kind]
            parts.append(f"{len(inside)} flagged {what}{'' if len(inside) == 1 else 's'} "
                         f"({shown})")
            fixes.append(option(fix, True))
    if not parts:
        return ""
    return (f"{' and '.join(parts)}: {' and '.join(fixes)} "
            f"leave{'s' if len(fixes) == 1 else ''} them out")


def span_words(names: Sequence[str], lo: int, hi: int, most: int = 4) -> str:
    """Steps `[lo, hi)` of a trace whose steps the log names `names` (`log_steps`), in those
    names: runs of consecutive steps joined ("15-18", "2.0-2.7" for chunks of step 2, "3-4,
    6-7" around a dropped step 5), at most `most` runs and then "...". "" for no step."""
    runs: list[list[str]] = []
    prev = None
    for name in names[lo:hi]:
        key = tuple(int(part) for part in name.split("."))  # (step,) or (step, chunk)
        if prev is not None and len(key) == len(prev) and key[:-1] == prev[:-1] \
                and key[-1] == prev[-1] + 1:
            runs[-1][1] = name
        else:
            runs.append([name, name])
        prev = key
    words = [a if a == b else f"{a}-{b}" for a, b in runs[:most]]
    return ", ".join(words + (["..."] if len(runs) > most else []))


@dataclass(frozen=True, eq=False)
class StepView(View):
    """Some steps of a Trace or DirTrace (`base`), in the order of `steps` (int64 `[S']`, indices
    into `base`): the same read interface, nothing copied until a step is read."""

    base: Any
    steps: torch.Tensor
    meta: dict

    def __post_init__(self) -> None:
        sizes = self.base.tokens_per_step[self.steps]
        object.__setattr__(self, "step_offsets", torch.cat([torch.zeros(1, dtype=torch.int64),
                                                            sizes.cumsum(0)]))

    def step(self, s: int) -> torch.Tensor:
        return self.base.step(int(self.steps[s]))

    def stored_step(self, s: int) -> torch.Tensor:
        return self.base.stored_step(int(self.steps[s]))

    def step_src_rank(self, s: int) -> torch.Tensor | None:
        return self.base.step_src_rank(int(self.steps[s]))

    def step_weights(self, s: int) -> torch.Tensor | None:
        return self.base.step_weights(int(self.steps[s]))

    def counts(self) -> torch.Tensor:
        """Routed pairs per logical expert of the kept steps, `[S', L, E]`."""
        return self.base.counts()[self.steps]

    def log_steps(self) -> list[str]:
        names = self.base.log_steps()
        return [names[s] for s in self.steps.tolist()]

    def __repr__(self) -> str:
        return f"StepView({shape_words(self)}: of {self.base!r})"


def select(trace: Any, steps: str | None = None, drop: Sequence[str] = ()) -> Any:
    """The steps of `trace` named by `steps` (a selection, module doc; None: all) without those
    flagged as any kind in `drop` (`FLAGS`; token traces only): `trace` itself when that is
    every step in order. InputError when nothing is left, or for a flag on counts only."""
    S = trace.num_steps
    keep = parse_steps(steps, S) if steps is not None else list(range(S))
    dropped: dict[str, list[int]] = {}
    if drop:
        if isinstance(trace, CountsTrace):
            raise InputError("warm-up, dummy and outlier steps are found in token rows; a "
                             "counts-only trace has none (select its steps by number instead)")
        flags = flag_steps(trace)
        counted: set[int] = set()  # a step flagged twice counts once, as its first kind
        for kind in drop:
            dropped[kind] = [s for s in flags[kind] if s in set(keep) and s not in counted]
            counted.update(dropped[kind])
        gone = {s for kind in drop for s in flags[kind]}
        keep = [s for s in keep if s not in gone]
    if not keep:
        raise InputError(f"the step selection leaves none of the trace's {S} steps")
    if keep == list(range(S)):
        return trace
    meta = dict(trace.meta, steps={"of": S, "kept": len(keep), "selection": steps,
                                   "dropped": dropped})
    if isinstance(trace, CountsTrace):  # its own root: its stage marks are its steps'
        if isinstance(meta.get("stages"), str):  # (`traces.stages`)
            meta["stages"] = "".join(meta["stages"][s] for s in keep)
        return CountsTrace(trace.counts[keep], meta)
    return StepView(trace, torch.tensor(keep, dtype=torch.int64), meta)


# What shapes a trace's steps before a run replays them (`shape_steps`): the keywords of
# `open_trace`, the settings of a run's `RunSpec` (its steps part), and the flags of `eplbsim
# run` and every command that reads a trace.
SHAPING = ("select_steps", "drop_warmup", "drop_dummy", "drop_outliers", "max_batched_tokens")
# The traces `shape_steps` made, each with the settings it made it by (`shaped_by`). Weak keys:
# a trace is forgotten with it, and one saved and read again is another trace.
_MADE: "weakref.WeakKeyDictionary[Any, dict[str, Any]]" = weakref.WeakKeyDictionary()


def shape_steps(trace: Any, *, select_steps: str | None = None, drop_warmup: bool = False,
                drop_dummy: bool = False, drop_outliers: bool = False,
                max_batched_tokens: int | None = None) -> Any:
    """`trace`'s steps as a run replays them: those `select_steps` names (a selection, module
    doc; None: all), less the steps flagged as warm-up, dummy or size outliers where asked
    (`select`), then each step of more than `max_batched_tokens` tokens cut into consecutive
    chunks of at most that many, as a chunked-prefill engine runs a long pass
    (`prefill_chunks.chunk_steps`; None: none cut). `trace` itself when nothing changes, else
    the trace made, remembered with the settings (`shaped_by`). A trace batched from requests
    (`meta["workload"]`, `workload.batch`) keeps to its workload's `max_batched_tokens`
    already: that value cuts none of its steps (a DP rank's batch keeps to it, not the
    gathered one), another is refused. InputError, naming the option as the caller writes it,
    for a value of the wrong kind."""
    for name, value in (("drop_warmup", drop_warmup), ("drop_dummy", drop_dummy),
                        ("drop_outliers", drop_outliers)):
        if not isinstance(value, bool):
            raise InputError(f"{option(name)} is True or False, got {value!r}")
    if max_batched_tokens is not None and (isinstance(max_batched_tokens, bool) or not
                                           isinstance(max_batched_tokens, int)
                                           or max_batched_tokens < 1):
        raise InputError(f"{option('max_batched_tokens')} must be an integer >= 1, got "
                         f"{max_batched_tokens!r}")
    if select_steps is not None and not isinstance(select_steps, str):
        raise InputError(f"{option('select_steps')} is text such as \"2:\" or \"0:100,150\", "
                         f"got {select_steps!r}")
    settings = dict(select_steps=select_steps, drop_warmup=drop_warmup, drop_dummy=drop_dummy,
                    drop_outliers=drop_outliers, max_batched_tokens=max_batched_tokens)
    workload = trace.meta.get("workload")
    budget = workload.get("max_batched_tokens") if isinstance(workload, dict) else None
    if max_batched_tokens is not None and budget is not None:
        if max_batched_tokens != budget:
            raise InputError(f"{option('max_batched_tokens', max_batched_tokens)}: the trace's "
                             f"steps were batched from requests with max_batched_tokens "
                             f"{budget}, which they keep to already; give that, or batch the "
                             f"requests with another (Workload(max_batched_tokens=...))")
        max_batched_tokens = None
    drop = [kind for kind, on in zip(FLAGS, (drop_warmup, drop_dummy, drop_outliers)) if on]
    made = select(trace, select_steps, drop)
    if max_batched_tokens is not None:
        made = chunk_steps(made, max_batched_tokens)
    if made is not trace:
        _MADE[made] = settings
    return made


def shaped_by(trace: Any) -> dict[str, Any] | None:
    """The settings (`SHAPING` -> value) `shape_steps` made `trace` by, or None when it did
    not make it (a trace read or built as it is, or one `shape_steps` left unchanged)."""
    try:
        return _MADE.get(trace)
    except TypeError:  # no trace at all: the caller's checks say so
        return None


SHORT = {"warmup": "warm-up", "dummy": "dummy", "outlier": "outlier"}  # kind: a word


def describe_selection(meta: dict) -> str:
    """"steps 2: of 32 (2 warm-up dropped)"-style words for a trace's `meta["steps"]`, then
    those of its chunks (`chunks.describe_chunks`); "" for neither."""
    info = meta.get("steps")
    if not info:
        return describe_chunks(meta)
    why = [f"{len(v)} {SHORT[k]}" for k, v in info["dropped"].items() if v]
    picked = f"steps {info['selection']}" if info["selection"] else "steps"
    chunks = describe_chunks(meta)
    return (f"{picked}: {info['kept']} of {info['of']}"
            + (f" ({', '.join(why)} dropped)" if why else "") + (f"; {chunks}" if chunks else ""))
