"""Model shapes for the cost model (DESIGN.md §8): what one MoE layer computes and moves.

Sizes are the models' published configurations (the `config.json` of each Hugging Face
repository named in `source`): `hidden` H, `intermediate` I (one routed expert's), `experts` E,
`top_k` K, `moe_layers`, the shared experts (always active, on every rank, not routed) and the
dtypes of weights, activations, dispatch and combine. Beside what time prices, a shape says
which of its layers route by a token-id table (`hash_layers`, DeepSeek-V4's `num_hash_layers`:
the first ones) and what its draft (MTP) layers are (`draft_layers`, `num_nextn_predict_layers`,
with their own experts and top-k where they differ: DeepSeek-V4.1's DSpark draft).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..base.errors import InputError

# bytes an element; a block-scaled 4-bit format counts its scales: NVFP4 one FP8 scale a 16
# elements, MXFP4 and MXFP8 one E8M0 scale a 32 (OCP MX spec); `fp4`, `int4` and `int8` are
# the bare elements (their configs do not say how they are scaled)
DTYPE_BYTES: dict[str, float] = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4, "int8": 1,
                                 "mxfp8": 1 + 1 / 32, "nvfp4": 0.5 + 1 / 16,
                                 "mxfp4": 0.5 + 1 / 32, "fp4": 0.5, "int4": 0.5}


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
    layers: int = 0  # decoder layers, MoE and dense (0: not stated)
    source: str = ""
    hash_layers: int = 0  # the first decoder layers, routed by token id (`num_hash_layers`)
    draft_layers: int = 0  # draft (MTP) layers beside the decoder layers
    draft_experts: int = 0  # a draft layer's routed experts (0: the target's `experts`)
    draft_top_k: int = 0  # a draft layer's top-k (0: the target's `top_k`)

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "experts", "top_k", "moe_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"a model shape's {name} must be a positive integer, "
                                 f"got {value!r}")
        if not isinstance(self.layers, int) or isinstance(self.layers, bool) or \
                self.layers and self.layers < self.moe_layers:
            raise InputError(f"a model shape's layers must be 0 (not stated) or at least its "
                             f"{self.moe_layers} MoE layers, got {self.layers!r}")
        for name in ("hash_layers", "draft_layers", "draft_experts", "draft_top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InputError(f"a model shape's {name} must be an integer >= 0, got "
                                 f"{value!r}")
        if self.hash_layers > self.moe_layers:
            raise InputError(f"a model shape's hash_layers ({self.hash_layers}) are MoE layers: "
                             f"at most its {self.moe_layers}")
        if self.draft_top_k > (self.draft_experts or self.experts):
            raise InputError(f"a model shape's draft_top_k ({self.draft_top_k}) must not exceed "
                             f"its draft's {self.draft_experts or self.experts} experts")
        for name in ("weight_dtype", "act_dtype", "dispatch_dtype", "combine_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise InputError(f"a model shape's {name} must be one of "
                                 f"{', '.join(DTYPE_BYTES)}, got {getattr(self, name)!r}")

    def bytes_of(self, what: str) -> float:
        """Bytes per element of `weight`, `act`, `dispatch` or `combine` (fractional for a
        4-bit format with its scales, `DTYPE_BYTES`)."""
        return DTYPE_BYTES[getattr(self, f"{what}_dtype")]

    @property
    def expert_weight_bytes(self) -> int:
        """One routed expert's weights, whole bytes: `3 H I` elements (scales included)."""
        return math.ceil(3 * self.hidden * self.intermediate * self.bytes_of("weight"))

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
                    layers=61, shared_experts=1, shared_intermediate=2048, weight_dtype="fp8",
                    dispatch_dtype="fp8", draft_layers=1)
_HF = "huggingface.co/"
_DEEPSEEK_V4 = dict(shared_experts=1, weight_dtype="fp4", dispatch_dtype="fp8", hash_layers=3,
                    draft_layers=1)
_LLAMA_4 = dict(hidden=5120, intermediate=8192, top_k=1, shared_experts=1,
                shared_intermediate=8192)

# The most served MoE models, as their published config.json says (`configs.shape_of` of it
# gives the same shape: tests/cost/test_configs.py checks each against aiconfigurator-core's copy);
# quantized weights are dispatched in FP8 (DeepEP's FP8 dispatch), BF16 ones in BF16.
MODELS: dict[str, ModelShape] = {
    "deepseek-v3": ModelShape(**_DEEPSEEK_V3, source=_HF + "deepseek-ai/DeepSeek-V3 "
                              "config.json (61 layers, the first 3 dense; FP8 block-quantized "
                              "weights; DeepEP's FP8 dispatch, BF16 combine)"),
    "deepseek-r1": ModelShape(**_DEEPSEEK_V3, source=_HF + "deepseek-ai/DeepSeek-R1 "
                              "config.json (the DeepSeek-V3 architecture)"),
    "kimi-k2": ModelShape(7168, 2048, 384, 8, 60, layers=61, shared_experts=1,
                          shared_intermediate=2048,
                          weight_dtype="fp8", dispatch_dtype="fp8",
                          source=_HF + "moonshotai/Kimi-K2-Instruct config.json (61 layers, "
                          "the first dense; one shared expert; FP8 weights)"),
    "glm-5": ModelShape(6144, 2048, 256, 8, 75, layers=78, shared_experts=1,
                        shared_intermediate=2048, draft_layers=1,
                        source=_HF + "zai-org/GLM-5 config.json (78 layers, the first 3 "
                        "dense; one shared expert; BF16)"),
    "qwen3-30b-a3b": ModelShape(2048, 768, 128, 8, 48, layers=48, source=_HF + "Qwen/Qwen3-30B-A3B "
                                "config.json (every layer MoE, BF16)"),
    "qwen3-235b-a22b": ModelShape(4096, 1536, 128, 8, 94, layers=94, source=_HF + "Qwen/"
                                  "Qwen3-235B-A22B config.json (every layer MoE, BF16)"),
    "qwen3-coder-480b-a35b": ModelShape(6144, 2560, 160, 8, 62, layers=62, source=_HF + "Qwen/"
                                        "Qwen3-Coder-480B-A35B-Instruct config.json (every "
                                        "layer MoE, BF16)"),
    "qwen1.5-moe-a2.7b": ModelShape(2048, 1408, 60, 4, 24, layers=24, shared_experts=1,
                                    shared_intermediate=5632,
                                    source=_HF + "Qwen/Qwen1.5-MoE-A2.7B config.json "
                                    "(one shared expert of 5632, BF16)"),
    "mixtral-8x7b": ModelShape(4096, 14336, 8, 2, 32, layers=32, source=_HF + "mistralai/"
                               "Mixtral-8x7B-v0.1 config.json (BF16)"),
    "mixtral-8x22b": ModelShape(6144, 16384, 8, 2, 56, layers=56, source=_HF + "mistralai/"
                                "Mixtral-8x22B-v0.1 config.json (BF16)"),
    "olmoe-1b-7b": ModelShape(2048, 1024, 64, 8, 16, layers=16, source=_HF + "allenai/"
                              "OLMoE-1B-7B-0924 config.json (BF16)"),
    "gpt-oss-120b": ModelShape(2880, 2880, 128, 4, 36, layers=36, weight_dtype="mxfp4",
                               dispatch_dtype="fp8", source=_HF + "openai/gpt-oss-120b "
                               "config.json (every layer MoE; MXFP4 experts)"),
    "gpt-oss-20b": ModelShape(2880, 2880, 32, 4, 24, layers=24, weight_dtype="mxfp4",
                              dispatch_dtype="fp8", source=_HF + "openai/gpt-oss-20b "
                              "config.json (every layer MoE; MXFP4 experts)"),
    "llama-4-scout": ModelShape(experts=16, moe_layers=48, layers=48, **_LLAMA_4,
                                source=_HF + "meta-llama/Llama-4-Scout-17B-16E-Instruct "
                                "config.json (every layer MoE, one shared expert, BF16)"),
    "llama-4-maverick": ModelShape(experts=128, moe_layers=24, layers=48, **_LLAMA_4,
                                   source=_HF + "meta-llama/Llama-4-Maverick-17B-128E-Instruct "
                                   "config.json (every second of 48 layers MoE, one shared "
                                   "expert, BF16)"),
    # every DeepSeek-V4 layer is MoE (TensorRT-LLM #13595: no first_k_dense_replace prefix), the
    # first `num_hash_layers` routed by a token-id table (`tid2eid`); experts in FP4
    # (`expert_dtype`), dispatched in FP8
    "deepseek-v4-flash": ModelShape(4096, 2048, 256, 6, 43, layers=43,
                                    shared_intermediate=2048, **_DEEPSEEK_V4,
                                    source=_HF + "deepseek-ai/DeepSeek-V4-Flash config.json (43 "
                                    "layers, every one MoE, the first 3 hash-routed; one MTP "
                                    "layer; one shared expert; FP4 experts)"),
    "deepseek-v4-pro": ModelShape(7168, 3072, 384, 6, 61, layers=61,
                                  shared_intermediate=3072, **_DEEPSEEK_V4,
                                  source=_HF + "deepseek-ai/DeepSeek-V4-Pro config.json (61 "
                                  "layers, every one MoE, the first 3 hash-routed; one MTP "
                                  "layer; one shared expert; FP4 experts)"),
    # V4.1 routes every layer by its router (no `num_hash_layers`: fastllm PR #727's table of
    # V4 -> V4.1 changes); its DSpark draft has 3 layers of 128 experts, top-3
    # (`dspark_n_routed_experts`, `dspark_num_experts_per_tok`); the config nests the text model
    # under `text_config`, `expert_dtype` under `quantization_config`
    "deepseek-v4.1-flash": ModelShape(5120, 2304, 384, 6, 40, layers=40, shared_experts=1,
                                      shared_intermediate=2304, weight_dtype="fp4",
                                      dispatch_dtype="fp8", draft_layers=3, draft_experts=128,
                                      draft_top_k=3,
                                      source=_HF + "deepseek-ai/DeepSeek-V4.1-Flash config.json "
                                      "@ dba1be0a40aa45a94ad051997016db3960a90277, as an mlx-lm "
                                      "port's deepseek_v41 config test quotes it (40 layers, every one MoE "
                                      "and learned; a 3-layer DSpark draft of 128 experts, "
                                      "top-3; FP4 experts)"),
    "minimax-m2.5": ModelShape(3072, 1536, 256, 8, 62, layers=62, weight_dtype="fp8",
                               dispatch_dtype="fp8", source=_HF + "MiniMaxAI/MiniMax-M2.5 "
                               "config.json (every layer MoE, FP8 weights)"),
}

DEFAULT_MODEL = "deepseek-v3"  # the model time is priced as when neither a flag nor the trace says
