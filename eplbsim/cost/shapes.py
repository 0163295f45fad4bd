"""Model shapes for the cost model (DESIGN.md §8): what one MoE layer computes and moves.

Sizes are the models' published configurations (the `config.json` of each Hugging Face
repository named in `source`): `hidden` H, `intermediate` I (one routed expert's), `experts` E,
`top_k` K, `moe_layers`, the shared experts (always active, on every rank, not routed) and the
dtypes of weights, activations, dispatch and combine.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError

DTYPE_BYTES = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class ModelShape:
    """One MoE model's layer shape; an expert is SwiGLU: gate and up `[2I, H]`, down `[H, I]`."""

    hidden: int
    intermediate: int
    experts: int
    top_k: int
    moe_layers: int
    shared_experts: int = 0
    shared_intermediate: int = 0
    weight_dtype: str = "bf16"
    act_dtype: str = "bf16"
    dispatch_dtype: str = "bf16"
    combine_dtype: str = "bf16"
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "experts", "top_k", "moe_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"a model shape's {name} must be a positive integer, "
                                 f"got {value!r}")
        for name in ("weight_dtype", "act_dtype", "dispatch_dtype", "combine_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise InputError(f"a model shape's {name} must be one of "
                                 f"{', '.join(DTYPE_BYTES)}, got {getattr(self, name)!r}")

    def bytes_of(self, what: str) -> int:
        """Bytes per element of `weight`, `act`, `dispatch` or `combine`."""
        return DTYPE_BYTES[getattr(self, f"{what}_dtype")]

    @property
    def expert_weight_bytes(self) -> int:
        """One routed expert's weights: `3 H I` elements."""
        return 3 * self.hidden * self.intermediate * self.bytes_of("weight")

    @property
    def shared_ratio(self) -> float:
        """One shared expert's work over one routed expert's, `shared_intermediate / I` (1 for
        a model without shared experts: a shared expert of a routed one's size)."""
        if not self.shared_experts:
            return 1.0
        return self.shared_intermediate / self.intermediate

    @property
    def flops_per_pair(self) -> int:
        """One (token, expert) pair through one expert: `2 x 3 H I` (multiply-adds of gate, up
        and down)."""
        return 6 * self.hidden * self.intermediate


_DEEPSEEK_V3 = dict(hidden=7168, intermediate=2048, experts=256, top_k=8, moe_layers=58,
                    shared_experts=1, shared_intermediate=2048, weight_dtype="fp8",
                    dispatch_dtype="fp8")

MODELS: dict[str, ModelShape] = {
    "deepseek-v3": ModelShape(**_DEEPSEEK_V3, source="huggingface.co/deepseek-ai/DeepSeek-V3 "
                              "config.json (61 layers, the first 3 dense; FP8 block-quantized "
                              "weights; DeepEP's FP8 dispatch, BF16 combine)"),
    "deepseek-r1": ModelShape(**_DEEPSEEK_V3, source="huggingface.co/deepseek-ai/DeepSeek-R1 "
                              "config.json (the DeepSeek-V3 architecture)"),
    "qwen3-235b-a22b": ModelShape(4096, 1536, 128, 8, 94, source="huggingface.co/Qwen/"
                                  "Qwen3-235B-A22B config.json (every layer MoE, BF16)"),
    "qwen1.5-moe-a2.7b": ModelShape(2048, 1408, 60, 4, 24, shared_experts=1,
                                    shared_intermediate=5632,
                                    source="huggingface.co/Qwen/Qwen1.5-MoE-A2.7B config.json "
                                    "(one shared expert of 5632, BF16)"),
    "mixtral-8x7b": ModelShape(4096, 14336, 8, 2, 32, source="huggingface.co/mistralai/"
                               "Mixtral-8x7B-v0.1 config.json (BF16)"),
    "olmoe-1b-7b": ModelShape(2048, 1024, 64, 8, 16, source="huggingface.co/allenai/"
                              "OLMoE-1B-7B-0924 config.json (BF16)"),
}

DEFAULT_MODEL = "deepseek-v3"  # the model time is priced as when neither a flag nor the trace says
SUFFIX_BREAKS = "-_.:"  # what may follow a known model's name in a longer one (`-Chat`, `-0324`)


def model_named(name: object) -> str | None:
    """The `MODELS` key a model name denotes, or None: a Hugging Face id or a free name, case
    and suffix tolerant (`Qwen/Qwen1.5-MoE-A2.7B-Chat` is `qwen1.5-moe-a2.7b`): the part after
    the last `/`, lower case, `_` and spaces read as `-`, is a key or starts with one followed
    by `-`, `_`, `.` or `:` (the longest such key)."""
    if not isinstance(name, str):
        return None
    text = name.strip().rsplit("/", 1)[-1].lower().replace("_", "-").replace(" ", "-")
    known = [key for key in MODELS if text == key or (
        text.startswith(key) and text[len(key)] in SUFFIX_BREAKS)]
    return max(known, key=len) if known else None


def trace_model(meta: dict, experts: int, top_k: int | None) -> str:
    """The model a trace of `experts` experts and `top_k` (None: counts only) is priced as
    when none is given: the one its `meta["model"]` names (`model_named`), else
    `DEFAULT_MODEL`. InputError when the named model's experts or top-k differ from the
    trace's (a flag naming the model prices it anyway)."""
    named = model_named(meta.get("model"))
    if named is None:
        return DEFAULT_MODEL
    shape = MODELS[named]
    if shape.experts != experts or top_k not in (None, shape.top_k):
        fewer = experts < shape.experts and top_k in (None, shape.top_k)
        raise InputError(f"the trace's meta names model {meta['model']!r} ({named}: "
                         f"{shape.experts} experts, top-{shape.top_k}), but the trace has "
                         f"{experts} experts" + (f", top-{top_k}" if top_k else "") + ": "
                         + (f"read it with --experts {shape.experts} if its ids never reach "
                            f"the last experts, or " if fewer else "")
                         + f"name the model to price it as with --model (--model {named} "
                         f"prices it so anyway)")
    return named


def model_mismatch(model: str, experts: int, top_k: int | None) -> str | None:
    """Words saying how `model`'s experts or top-k differ from a trace's, or None."""
    shape = MODELS[model]
    if shape.experts == experts and top_k in (None, shape.top_k):
        return None
    return (f"model {model} has {shape.experts} experts, top-{shape.top_k}; the trace has "
            f"{experts}" + (f", top-{top_k}" if top_k else "") + ": its loads are priced as "
            "that model's")
