"""The run parts `RunSpec` holds: `dispatch` (policy, mode, view, rng, engine sources),
`solver`, `schedule` (rebalancing and migration), `topology` (GPUs, nodes, slots), `cost`
(time on a model and device) and `steps` (which of the trace's steps are replayed, and how long
ones are cut).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..base.errors import InputError
from ..base.limits import (MAX_EXPERT_BYTES, MAX_EXPERTS, MAX_GPUS, MAX_HIDDEN, MAX_SEED, MAX_SLOTS,
                           MAX_TOP_K)
from ..base.registry import Joined, name_of
from ..cost import COST_MODELS, DEVICES, DeviceProfile, ModelShape
from ..cost import check_options as check_cost_options
from ..cost import describe as describe_cost
from ..cost.buffers import GIB, dispatch_cap
from ..cost.catalog import NAME_FORMS, model_label, model_shape
from ..cost.shapes import DEFAULT_MODEL
from ..dispatch import FAULTS, POLICIES, DispatchPolicy, FilePolicies, resolve_policy
from ..engines import ENGINE_POLICIES, ENGINE_SOLVERS, as_sources, resolve_solver
from ..migration import MIGRATIONS
from ..placement import VIEWS
from ..placement.topology import Topology
from ..ranks import MODES, RNG_RELATIONS
from ..schedule.predictors import PREDICTORS
from ..schedule.switch import REBALANCE_MODES
from ..solvers import SOLVERS, check_options, find_solver
from ..solvers.exact import NODE_LIMIT
from ..solvers.lplb import TOPOLOGIES as LPLB_TOPOLOGIES
from ..solvers.recovery import RECOVERY_NAMES
from ..traces.stages import DECODE_TOKENS, STAGES
from ..traces.steps import OUTLIER_FACTOR, SHAPING
from ..traces.synth import DEFAULT_SIZES
from .knobs import COMMANDS, READS, SYNTH, WITH_INFO, Part, changed_fields, knob, they
from .values import (Device, EngineFlags, EngineSources, File, Integer, Model, Name, Number,
                     Options, Ranks, StepSelection, Switch)


NODE_GPUS = 8  # GPUs a node by default, as H100/H200/B200 boxes have
MIN_REDUNDANT = 16  # the fewest redundant slots by default
FAILING = frozenset({"run", "sweep", "review"})  # the commands that simulate dead ranks


@dataclass(frozen=True)
class DispatchPart(Part):
    """How the ranks choose replicas: the policy, the mode, what each rank knows, its
    generator, and the run's seed and device."""

    policy: Any = knob("ordinal", "dispatch policies (one of your own: "
                       "path/to/file.py:function, see docs/api.md; a fault to replay: "
                       "unmapped, docs/guide/17-rebalance.md)",
                       Name(Joined(POLICIES, FAULTS, ENGINE_POLICIES, FilePolicies()), "policy",
                            callables=True, entry=DispatchPolicy),
                       flags=("--policies",), listed="static,random,row,ordinal",
                       commands=COMMANDS - {"review"},  # a review names its CANDIDATE
                       metavar="NAME,..")
    mode: str = knob("none", "none (every rank dispatches every token) or a2a (each token "
                     "once, by its owner)", Name(MODES, "mode"), listed="none,a2a",
                     metavar="MODE,..")
    view: Any = knob("full", "what each rank knows of the placement",
                     Name(VIEWS, "view", callables=True))
    rng: str = knob("independent", "how the ranks' random streams relate (random, lp)",
                    Name(RNG_RELATIONS, "rng relation"))
    drift_p: float = knob(0.05, "per-step drift probability for --rng drift", Number(0, 1))
    rank_offset: bool | None = knob(
        None, "add the rank to the policy's offset (default: ordinal in a2a mode, where it "
        "balances best, and never trtllm); --rank-offset: trtllm too, in every mode (its "
        "offset_by_ep_rank, rank-variant in none); --no-rank-offset: neither",
        Switch(optional=True))
    spill_slack: float = knob(0.0, "a spill policy's capacity above its own (spill: exact "
                              "balance, llep: 1.1 x the mean), as a share: 0.1 lets each GPU "
                              "take a tenth more pairs before it spills", Number(0, 100))
    seed: int = knob(0, "seeds every random choice: the scenario, the rank streams, "
                     "static's tables, the toy MoE layer", Integer(0, most=MAX_SEED),
                     commands=SYNTH)
    device: str = knob("cpu", "where dispatch runs: cpu, cuda or auto", Device())
    hidden: int = knob(8, "hidden size of the toy MoE layer that measures output error",
                       Integer(1, most=MAX_HIDDEN))
    tp: int = knob(1, "attention tensor-parallel size: EP rank r is TP rank r % tp of DP "
                   "group r // tp (ascend-fixed reads it)", Integer(1, most=MAX_GPUS))
    shared_experts: int | None = knob(
        None, "shared experts every token runs in each layer, counted as GPU work (each the "
        "size of the model's shared expert, --model, else of a routed one; on the token's own "
        "rank in a2a unless the policy sends it, split over the GPUs in none); default: the "
        "model's when a policy dispatches them (waterfill), else none",
        Integer(0, optional=True, most=MAX_TOP_K))
    engine_source: dict = knob({}, "run an engine's own code, for sglang:* and vllm:* policies "
                               "and solvers, from this release (fetched on first use) or "
                               "folder (a checkout's package parent: SGLang's python/, or the "
                               "repository root) instead of the pinned release; several, "
                               "comma-separated, run side by side",
                               EngineSources("engine_source"), flags=("--engine-source",),
                               metavar="ENGINE==VERSION|ENGINE=PATH")
    engine_args: str | None = knob(None, "SGLang server flags for sglang:auto, which "
                                   "dispatches with whatever the release's own settings logic "
                                   "picks for them, e.g. '--enable-eplb --moe-a2a-backend none'",
                                   EngineFlags(), metavar="'FLAGS'")

    def relate(self) -> None:
        object.__setattr__(self, "engine_source", dict(as_sources(self.engine_source)))
        name, entry = resolve_policy(self.policy)
        if self.mode not in entry.modes:
            raise InputError(f"policy {name} runs only in {' or '.join(entry.modes)} mode: "
                             f"{entry.summary or 'see eplbsim policies'}")


@dataclass(frozen=True)
class SolverPart(Part):
    """How placements are solved, or the placement to use instead."""

    solver: Any = knob("deepseek", "placement solver (an engine's own: sglang:deepseek, ...; a "
                       "function in a file: path/to/file.py:function)",
                       Name(Joined(SOLVERS, ENGINE_SOLVERS, FilePolicies("solver")), "solver",
                            callables=True))
    solver_options: dict = knob({}, "solver option, e.g. anti_colocation=true, or exact's "
                                f"node_limit=N (its work budget a layer, default "
                                f"{NODE_LIMIT} branch-and-bound nodes: the same placement on "
                                f"every machine) (repeat for several)",
                                Options("solver_option"), flags=("--solver-option",),
                                metavar="KEY=VALUE")
    placement: Any = knob(None, "a JSON placement to serve every step instead of solving (a "
                          "`solve --json` output, a bare phy2log [L][P], or an SGLang "
                          "physical_to_logical_map)", File("a JSON placement", placement=True),
                          metavar="FILE")
    lplb_topology: str | None = knob(
        None, "the lplb solver's redundancy topology (default cube; the same as --solver-option "
        "redundancy=...; a torus takes --solver-option torus_rows=M)",
        Name(LPLB_TOPOLOGIES, "redundancy topology", optional=True))
    affinity_slack: float | None = knob(
        None, "the affinity solver's slack: its max GPU load stays within (1 + slack) times the "
        "balance solver's (default 0.05; the same as --solver-option slack=...)",
        Number(0, 1, optional=True), metavar="SLACK")
    solve_from: str = knob(
        "all", "solve the placement from the steps of one stage only, prefill or decode (as "
        "the log marks them, else by --decode-tokens), and serve every step on it",
        Name(("all",) + STAGES, "stage"), metavar="all|prefill|decode")
    decode_tokens: int = knob(
        DECODE_TOKENS, "a step the log does not mark prefill or decode is decode when it has "
        "at most N tokens (for --solve-from and --stage-placements)", Integer(0), metavar="N")

    def relate(self) -> None:
        fn = find_solver(resolve_solver(self.solver))  # an engine's: its options are checked
        options = dict(self.solver_options)
        for field_name, solver, option in (("lplb_topology", "lplb", "redundancy"),
                                           ("affinity_slack", "affinity", "slack")):
            value = getattr(self, field_name)
            if value is None:
                continue
            flag = "--" + field_name.replace("_", "-")
            if fn is not SOLVERS[solver]:
                raise InputError(f"{field_name} ({flag}) is the {solver} solver's (--solver "
                                 f"{solver}); the solver is {name_of(fn)}")
            if options.get(option, value) != value:
                raise InputError(f"{field_name} {value} and solver option "
                                 f"{option}={options[option]} disagree")
            options[option] = value
        object.__setattr__(self, "solver_options", check_options(fn, options))


@dataclass(frozen=True)
class SchedulePart(Part):
    """When placements are re-solved and from what forecast (`schedule.plan`)."""

    rebalance_every: int | None = knob(
        None, "re-solve the placement every N steps from predicted loads, the first time "
        "after the first window (default: once, from the whole trace)",
        Integer(1, optional=True), metavar="N")
    window: int | None = knob(None, "steps of history the predictor reads (default N)",
                              Integer(1, optional=True), metavar="W")
    predictor: Any = knob("window", "window: sum of the last W steps; ema: decayed sum; "
                          "decay: TensorRT-LLM's decayed statistic (h <- h * 0.95 + counts); "
                          "oracle: the loads of the steps about to run; hashed: those on "
                          "hash-routed layers (their token ids give them), window on the others",
                          Name(PREDICTORS, "predictor", callables=True))
    decay: float | None = knob(None, "the per-step factor in [0, 1] of ema (default 1 - 1/W) "
                               "and of decay, TensorRT-LLM's statistic (default 0.95)",
                               Number(0, 1, optional=True))
    initial: Any = knob(None, "the placement before the first rebalance: trivial, or a JSON "
                        "placement (as --placement)",
                        File("a JSON placement", placement=True, absent="trivial"),
                        metavar="trivial|FILE")
    skip_above: float | None = knob(
        None, "skip a rebalance when the placement in service has a balancedness (mean / max "
        "GPU load, mean over layers) above B on the forecast", Number(0, 1, optional=True),
        metavar="B")
    migration_aware: bool = knob(True, "lay each new placement out over the one in service "
                                 "to move fewer experts", Switch())
    expert_bytes: int | None = knob(
        None, "bytes of one expert's weights, to price migrations and their stalls (default: "
        "one routed expert of the model shape, --model)",
        Integer(0, optional=True, most=MAX_EXPERT_BYTES))
    rebalance_mode: str = knob(
        "sync", "sync: serving stalls until a rebalance's copies land; async: the copies go on "
        "in the background while the old placement serves, each rank switching when they land",
        Name(REBALANCE_MODES, "rebalance mode"))
    copy_steps: int = knob(1, "async: steps a rebalance's copies take in the background",
                           Integer(1), metavar="N")
    switch_delay: int = knob(
        0, "async: each rank switches to the new placement up to D steps after the copies "
        "land, a seeded delay per rank and rebalance (0: all together)", Integer(0),
        metavar="D")
    migration: str = knob(
        "eplbsim", "who moves the weights at each rebalance: eplbsim (its own migration "
        "model), or sglang or vllm: that engine's own updater from --engine-source, on "
        "simulated ranks whose weights say whose they are, every slot checked "
        "(slot_mismatch, lost_experts, moved_wrong_frac) and its transfers priced beside "
        "eplbsim's model", Name(MIGRATIONS, "migration"))
    unmoved: int | None = knob(
        None, "a fault for --migration sglang|vllm: expert tensor I (0 w13, 1 w2, 2 its scale) "
        "is left out of the list the engine's updater moves while the slot keeps it, as in "
        "vLLM #47588 (a scale moved without its weight)", Integer(0, optional=True, most=2),
        metavar="I")
    map_lead: int = knob(
        0, "a fault: each rebalance's new maps serve N steps before its weights land, the "
        "slots still holding the old experts (a map committed ahead of its weights); a2a "
        "counts the pairs sent to a slot holding another expert", Integer(0), metavar="N")

    def relate(self) -> None:
        if self.rebalance_every is None:
            unused = changed_fields(self, ("window", "predictor", "decay", "initial", "skip_above",
                                     "rebalance_mode", "copy_steps", "switch_delay",
                                     "migration", "unmoved", "map_lead"))
            if unused:
                raise InputError(f"{', '.join(unused)} only apply with rebalance_every (a "
                                 f"rebalance schedule); without it one placement is solved "
                                 f"from the whole trace")
            return
        if self.unmoved is not None and self.migration == "eplbsim":
            raise InputError("unmoved leaves a tensor out of what an engine's updater moves: "
                             "it needs migration sglang or vllm")
        if self.migration != "eplbsim" and self.rebalance_mode != "sync":
            raise InputError(f"migration {self.migration} moves the weights with the engine's "
                             f"updater at the rebalance, as a sync rebalance does; async "
                             f"rebalances are eplbsim's own model only (rebalance_mode sync)")
        if self.map_lead and (self.rebalance_mode != "sync" or
                              self.map_lead > self.rebalance_every):
            raise InputError(f"map_lead {self.map_lead} needs rebalance_mode sync and at most "
                             f"rebalance_every ({self.rebalance_every}) steps")
        if self.rebalance_mode == "sync":
            unused = changed_fields(self, ("copy_steps", "switch_delay"))
            if unused:
                raise InputError(f"{', '.join(unused)} only apply with rebalance_mode async "
                                 f"(sync serves the new placement on every rank at once)")
        elif self.copy_steps + self.switch_delay > self.rebalance_every:
            raise InputError(f"copy_steps + switch_delay ({self.copy_steps} + "
                             f"{self.switch_delay}) must be at most rebalance_every "
                             f"({self.rebalance_every}): every rank serves a placement before "
                             f"the next rebalance")

    def steps(self) -> int:
        """Steps a scenario needs for four rebalances after the first window (the default
        when none is given; the scenario default without a schedule)."""
        base = DEFAULT_SIZES["steps"]
        if self.rebalance_every is None:
            return base
        return max(base, (self.window or self.rebalance_every) + 4 * self.rebalance_every)


@dataclass(frozen=True)
class TopologyPart(Part):
    """The cluster: EP ranks = GPUs, nodes, redundant slots, expert groups."""

    gpus: int = knob(8, "GPUs = EP ranks", Integer(1, most=MAX_GPUS),
                     commands=frozenset({"run", "sweep", "review"}))
    gpus_per_node: int | None = knob(
        None, f"GPUs per node (default: {NODE_GPUS} when the GPUs are a multiple of "
        f"{NODE_GPUS}, as H100/H200/B200 boxes have, else all on one node; for ranks under "
        f"torchrun: its LOCAL_WORLD_SIZE)", Integer(1, optional=True, most=MAX_GPUS))
    redundant: int | None = knob(
        None, f"redundant physical slots, P = E + redundant (default: one a GPU, at least "
        f"{MIN_REDUNDANT}, rounded up so the GPUs divide the slots; with a placement file, "
        f"the file's)", Integer(-MAX_SLOTS, optional=True, most=MAX_SLOTS))
    groups: int | None = knob(None, "expert groups (default: the trace's, else 1)",
                              Integer(1, optional=True, most=MAX_EXPERTS))
    fail_ranks: tuple[int, ...] | None = knob(
        None, "EP ranks that die at --fail-at: from that step on the survivors (compacted in "
        "rank order) serve on the --recovery placement; an expert left with no replica has "
        "its pairs lost (lost_frac), never dispatched; the results are the survivors' over "
        "the steps from the failure, with what the repair copies (repair_bytes, repair_ms)",
        Ranks(), commands=FAILING, metavar="R,..")
    fail_at: int = knob(0, "with --fail-ranks: the first step the ranks are dead; the "
                        "placement in service then is the one repaired", Integer(0),
                        commands=FAILING, metavar="STEP")
    recovery: str = knob(
        RECOVERY_NAMES[0], "with --fail-ranks: the survivors' placement: a twin of vLLM "
        "#46370's recovery (dead slots -1, donors interleaved over the survivors) or #38862's "
        "(reassign_missing_experts, not load-balanced), or resolve: the run's solver on the "
        "survivors' slots, the comparison", Name(RECOVERY_NAMES, "recovery"),
        commands=FAILING)

    def relate(self) -> None:
        self.topology()
        if self.fail_ranks is None:
            unused = changed_fields(self, ("fail_at", "recovery"))
            if unused:
                raise InputError(f"{they(unused, 'apply')} only with fail_ranks (ranks that "
                                 f"die)")
        elif self.fail_ranks[-1] >= self.gpus or len(self.fail_ranks) == self.gpus:
            raise InputError(f"fail_ranks must be some of the ranks 0..{self.gpus - 1}, not "
                             f"all, got {list(self.fail_ranks)}")

    def topology(self) -> Topology:
        """The cluster as a Topology (`gpus_per_node` None: `NODE_GPUS` a node when they
        divide the GPUs, else one node)."""
        per_node = self.gpus_per_node
        if per_node is None and self.gpus % NODE_GPUS == 0:
            per_node = NODE_GPUS
        return Topology(self.gpus, per_node)

    def fit(self, num_experts: int, slots: int | None = None, file: Any = None) -> int:
        """The redundant slots for `num_experts` experts: those of a placement of `slots`
        slots (`file` names it) when one is served, else `redundant` when given, else the
        default (one a GPU, at least `MIN_REDUNDANT`, rounded up so the GPUs divide the
        slots). InputError when a given value disagrees with the placement or does not divide
        over the GPUs, naming the nearest values that do."""
        G = self.gpus
        if slots is not None:
            if self.redundant not in (None, slots - num_experts):
                raise InputError(f"the placement {file} has {slots} slots for {num_experts} "
                                 f"experts (redundant {slots - num_experts}), but redundant is "
                                 f"{self.redundant}: the placement decides the slots (leave "
                                 f"redundant out)")
            return slots - num_experts
        if self.redundant is None:
            least = max(MIN_REDUNDANT, G)
            return least + (-(num_experts + least)) % G
        over = (num_experts + self.redundant) % G
        if over:
            near = [r for r in (self.redundant - over, self.redundant + G - over) if r >= 0]
            raise InputError(f"{num_experts} experts + {self.redundant} redundant = "
                             f"{num_experts + self.redundant} slots do not divide over {G} "
                             f"GPUs; redundant {' or '.join(map(str, near))} would (slots a "
                             f"multiple of {G})")
        return self.redundant


@dataclass(frozen=True)
class CostPart(Part):
    """Time (DESIGN.md §8): the cost model that turns counted loads into milliseconds, the
    model shape and the device profile it reads."""

    cost: Any = knob(None, "cost model turning loads into time: roofline, measured "
                     "(aiconfigurator-core's measured kernels: pip install 'eplbsim[cost]'), or "
                     "a callable (default off: no time metrics)",
                     Name(COST_MODELS, "cost model", callables=True, optional=True))
    cost_options: dict = knob({}, "cost model option, e.g. framework=sglang (measured: "
                              "trtllm, sglang or vllm) or eta_compute=0.7 (roofline)",
                              Options("cost_option"), flags=("--cost-option",),
                              metavar="KEY=VALUE")
    model: Any = knob(None, f"model the cost model prices (--cost), and the size of its shared "
                      f"expert: a name (eplbsim models lists them) or the path of its Hugging "
                      f"Face config.json (default: the model the trace's meta names, when "
                      f"eplbsim knows it, else {DEFAULT_MODEL}, said in the header)",
                      Model(), metavar="NAME|config.json")
    device_profile: str = knob("h200", "device profile the cost model reads (--cost)",
                               Name(DEVICES, "device profile"))
    overlap: bool = knob(False, "layer time = max(compute, communication) instead of their sum",
                         Switch())
    dispatch_buffer_gib: float | None = knob(
        None, "a2a: the size limit of DeepEP's low-latency buffer, GiB (its bound is 32): the "
        "most tokens a rank may dispatch a step follows from it, the model's hidden size and "
        "the placement's physical experts, and the steps whose busiest rank dispatches more "
        "are counted (buffer_overflow_steps)", Number(1 / 1024, 1024, optional=True),
        metavar="GIB")
    dispatch_cap: int | None = knob(
        None, "a2a: the most tokens a rank may dispatch a step, given rather than derived "
        "from --dispatch-buffer-gib", Integer(1, optional=True), metavar="TOKENS")

    def relate(self) -> None:
        if self.dispatch_cap is not None and self.dispatch_buffer_gib is not None:
            raise InputError("give dispatch_cap or dispatch_buffer_gib, not both (the cap is "
                             "derived from the buffer)")
        if self.cost is None:
            unused = changed_fields(self, ("cost_options",))
            if unused:
                raise InputError("cost_options only apply with a cost model (cost)")
            return
        object.__setattr__(self, "cost_options", check_cost_options(self.cost,
                                                                    self.cost_options))

    def model_shared_experts(self) -> int:
        """The model's shared experts; InputError when it has none (for a policy that places
        them)."""
        count = self.shape.shared_experts
        if not count:
            raise InputError(f"the policy dispatches the shared expert, but model {self.name} "
                             f"has none: give shared_experts (--shared-experts N) or a model "
                             f"with one ({NAME_FORMS})")
        return count

    def shared_work(self, shared_experts: int | None, placed: bool) -> float:
        """Each token's shared-expert work in a layer, in routed pairs (0: not counted):
        `shared_experts` (None: the model's when the policy places them, `placed`, or when a
        cost model prices the time, which is the model's whole MoE layer; else 0) times the
        model's shared expert over a routed one (`ModelShape.shared_ratio`)."""
        if shared_experts is None:
            shared_experts = (self.model_shared_experts() if placed else
                              self.shape.shared_experts if self.cost is not None else 0)
        return shared_experts * self.shape.shared_ratio

    def profiles(self) -> tuple[ModelShape, DeviceProfile]:
        """The model shape and device profile the cost model reads."""
        return self.shape, DEVICES[self.device_profile]

    @property
    def name(self) -> str:
        """The model's name (`cost.catalog.model_label`: a known name, the config path as
        given), `DEFAULT_MODEL` before a trace has decided it (`replay.spec_for_trace`)."""
        return model_label(DEFAULT_MODEL if self.model is None else self.model)

    @property
    def shape(self) -> ModelShape:
        """The model's shape (`cost.catalog.model_shape`)."""
        return model_shape(DEFAULT_MODEL if self.model is None else self.model)

    def buffer_cap(self, num_slots: int) -> int | None:
        """The most tokens a rank may dispatch a step (`dispatch_cap`, else derived from
        `dispatch_buffer_gib` for the model's hidden size and `num_slots` physical experts:
        `cost.buffers.dispatch_cap`); None when neither is set."""
        if self.dispatch_buffer_gib is None:
            return self.dispatch_cap
        return dispatch_cap(round(self.dispatch_buffer_gib * GIB), self.shape.hidden, num_slots)

    def describe(self, num_gpus: int) -> str:
        """What the compute times come from (`cost.describe`; for `measured`, the table, read
        and checked now)."""
        return describe_cost(self.cost, *self.profiles(), num_gpus, self.cost_options)


@dataclass(frozen=True)
class StepsPart(Part):
    """Which of the trace's steps a run replays, and how long ones are cut: the settings of
    `traces.steps.shape_steps` (`SHAPING`), which `replay` and `compare` apply to the trace
    they are given (`replay.shaped`), and a command that reads a trace applies as it reads
    (`Source`, which extends this part). A trace batched from requests keeps to its
    workload's `max_batched_tokens` already (`shape_steps`)."""

    select_steps: str | None = knob(
        None, "replay only these steps of the trace: steps and ranges of its own numbering, "
        "e.g. 2:, 0:100,150 or :-1 (trace info numbers them)", StepSelection(),
        metavar="STEPS", commands=READS)
    drop_warmup: bool = knob(False, "leave out warm-up steps: two or more rows all routed "
                             "alike, as an engine's start-up profiling pass (trace info flags "
                             "them)", Switch(), commands=READS)
    drop_dummy: bool = knob(False, "leave out dummy steps: the padding batches a data-parallel "
                            "rank runs when idle, a step repeated row for row (trace info "
                            "flags them)", Switch(), commands=READS)
    drop_outliers: bool = knob(False, f"leave out steps of more than {OUTLIER_FACTOR}x the "
                               f"median tokens (trace info flags them)", Switch(),
                               commands=READS)
    max_batched_tokens: int | None = knob(
        None, "requests: tokens a step (decode rows and prefill chunks; default 8192); a "
        "trace: its steps of more tokens are cut into consecutive chunks of at most N, as a "
        "chunked-prefill engine runs a long pass, after the steps are selected (default: "
        "none cut)", Integer(1, optional=True), metavar="N", commands=WITH_INFO)

    def shaping(self) -> dict[str, Any]:
        """The settings as `shape_steps` and `open_trace` take them (`SHAPING`)."""
        return {name: getattr(self, name) for name in SHAPING}

    @property
    def selects(self) -> bool:
        """Whether some steps are selected or dropped (else every step is kept)."""
        return (self.select_steps is not None or self.drop_warmup or self.drop_dummy
                or self.drop_outliers)
