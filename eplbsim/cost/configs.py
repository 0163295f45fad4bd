"""A Hugging Face `config.json` read into a `ModelShape` (DESIGN.md §5, §8).

Dimensions: `H` hidden, `I` one routed expert's intermediate, `E` routed experts, `K` top-k,
`L` decoder layers.

The keys are read from tables of the names real configs use (`EXPERT_KEYS`, `TOP_K_KEYS`, ...),
each table in order of precedence; a key whose value is null counts as absent. A multimodal
config's language model is its `text_config` (Llama 4, Qwen3-VL/3.5, Kimi-K2.5, Gemma 4).
Anything the cost model needs and the config does not say, a config that is not an MoE
model, or a value of the wrong kind is an InputError of one line naming the key and the file;
nothing is guessed. A bare `top_k` is never read as the router's: Kimi-K2.5's `text_config`
holds `top_k: 50`, a sampling setting.

Which layers are MoE (`moe_layers`): a per-layer list says so outright (`layers_block_type`
"moe", `hybrid_override_pattern` "E", `mlp_layer_types` "sparse", `moe_layer_freq` as a list of
0/1, `moe_layers` as indices); else layer `i` is MoE when every rule its config states holds:
`i >= first_k_dense_replace` and `i % moe_layer_freq == 0` (DeepSeek), `(i + 1) %
decoder_sparse_step == 0` and `i` not in `mlp_only_layers` (Qwen-MoE), `(i + 1) %
interleave_moe_layer_step == 0` (Llama 4), `moe_layer_start_index <= i <= moe_layer_end_index`
and `(i + 1) % moe_layer_interval == 0` (ERNIE 4.5); `enable_moe_block: false` (Gemma 4) is none.

Hash-routed layers (`hash_layers`): `num_hash_layers` (DeepSeek-V4: its first layers take their
experts from a token-id table, `tid2eid`). Draft (MTP) layers: `num_nextn_predict_layers`, their
experts and top-k the target's unless the config gives the draft its own
(`DRAFT_EXPERT_KEYS`, `DRAFT_TOP_K_KEYS`: DeepSeek-V4.1's DSpark draft).

The experts' weight dtype: the config's `expert_dtype` (DeepSeek-V4; in its
`quantization_config`, DeepSeek-V4.1), else its quantization
(`quantization_config`, or the ModelOpt `hf_quant_config.json` beside it): the experts' own entry
(`moe_quant_algo`, a `quantized_layers` entry of routed experts), else `quant_algo`, else the
weights of `config_groups`, else `quant_method`; else `torch_dtype` / `dtype`; else bf16. A
latent MoE (Nemotron-3 `moe_latent_size`, `routed_expert_hidden_size`) runs its routed experts
and their dispatch at the latent size: that is the shape's `H`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ..base.errors import InputError
from ..base.files import regular_file
from ..base.limits import MAX_EXPERTS, MAX_LAYERS, MAX_TOP_K, shown
from .shapes import ModelShape

MAX_CONFIG_BYTES = 64 * 2**20  # a config.json read whole (ModelOpt's run to 2.4 MB)

EXPERT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts",
               "num_routed_experts")
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "experts_per_token", "moe_topk",
              "moe_k", "top_k_experts")
HIDDEN_KEYS = ("hidden_size", "d_model")
LATENT_KEYS = ("moe_latent_size", "routed_expert_hidden_size")
EXPERT_SIZE_KEYS = ("moe_intermediate_size", "expert_intermediate_size")
LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layers")
SHARED_COUNT_KEYS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
HASH_LAYER_KEYS = ("num_hash_layers",)
DRAFT_LAYER_KEYS = ("num_nextn_predict_layers",)
DRAFT_EXPERT_KEYS = ("dspark_n_routed_experts",)
DRAFT_TOP_K_KEYS = ("dspark_num_experts_per_tok",)
SHARED_SIZE_KEYS = ("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size",
                    "shared_intermediate_size", "share_expert_dim")
# model types whose `intermediate_size` is one routed expert's (their dense MLP, if any, has
# its own key): Mixtral, gpt-oss, MiniMax (M3's dense layers: `dense_intermediate_size`),
# Llama 4 (`intermediate_size_mlp`), Phi-3.5-MoE, Granite-MoE, Jamba
EXPERT_SIZED_TYPES = ("mixtral", "gpt_oss", "minimax", "minimax_m2", "minimax_m3",
                      "minimax_m3_vl", "llama4_text", "phimoe", "granitemoe", "jamba")
# model types with shared experts their config does not count: Llama 4's one shared expert
# (`Llama4TextMoe.shared_expert`) is a routed one's size
SHARED_BY_TYPE = {"llama4_text": 1}
TORCH_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8_e4m3fn": "fp8"}
EXPERT_DTYPES = {"fp4": "fp4", "fp8": "fp8", "bf16": "bf16"}  # DeepSeek-V4's `expert_dtype`
# a quantization's name (`quant_algo`, `quant_method`), upper case, to the weight dtype; the
# first pattern found in it decides (W4A8_NVFP4 is nvfp4, FP8_BLOCK_SCALES fp8)
QUANT_PATTERNS = (("NVFP4", "nvfp4"), ("MXFP4", "mxfp4"), ("MXFP8", "mxfp8"), ("FP8", "fp8"),
                  ("W4A", "int4"), ("INT4", "int4"), ("AWQ", "int4"), ("W8A", "int8"),
                  ("INT8", "int8"))
ROUTED_EXPERTS = re.compile(r"(^|\.)experts(\.|$)")  # a `quantized_layers` key of routed experts


def read_config(path: str | Path) -> dict[str, Any]:
    """The JSON object in the file `path` (at most `MAX_CONFIG_BYTES`, UTF-8); InputError of
    one line naming the file otherwise."""
    path = regular_file(path, "config.json")
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise InputError(f"{path}: {size:,} bytes, more than a config.json holds (at most "
                         f"{MAX_CONFIG_BYTES:,})")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InputError(f"{path}: not a JSON config ({str(exc).splitlines()[0][:120]})") \
            from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: a config.json holds one JSON object, got "
                         f"{type(data).__name__}")
    return data


def quant_beside(path: str | Path) -> dict[str, Any] | None:
    """The `quantization` object of ModelOpt's `hf_quant_config.json` beside the config file
    `path` (`NAME_hf_quant_config.json` beside `NAME_config.json`), or None."""
    path = Path(path)
    stem = path.name[:-len("config.json")] if path.name.endswith("config.json") else None
    if stem is None:
        return None
    side = path.with_name(stem + "hf_quant_config.json")
    if not side.is_file():
        return None
    quant = read_config(side).get("quantization")
    return quant if isinstance(quant, dict) else None


def config_shape(path: str | Path, source: str = "") -> ModelShape:
    """The shape the `config.json` at `path` describes (module doc), with the quantization
    beside it (`quant_beside`); `source` says where it came from (default: the path)."""
    config = read_config(path)
    return shape_of(config, str(path), quant_beside(path), source or f"config.json {path}")


def _get(config: dict[str, Any], keys: tuple[str, ...]) -> tuple[str, Any] | None:
    """`(key, value)` of the first of `keys` `config` holds not null, or None."""
    return next(((k, config[k]) for k in keys if config.get(k) is not None), None)


def _count(config: dict[str, Any], keys: tuple[str, ...], where: str, what: str,
           least: int = 1, required: bool = True, most: int | None = None) -> int | None:
    """The integer of the first of `keys` (at least `least`, at most `most`); InputError naming
    the key and `where` when it is not one, or when none is there and `required`."""
    found = _get(config, keys)
    if found is None:
        if not required:
            return None
        raise InputError(f"{where}: no {what} ({' or '.join(keys)})")
    key, value = found
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InputError(f"{where}: {key} must be an integer >= {least} ({what}), got "
                         f"{shown(value)}")
    if most is not None and value > most:
        raise InputError(f"{where}: {key} is {shown(value)} ({what}), above the cap of {most}")
    return value


def language_model(config: dict[str, Any]) -> dict[str, Any]:
    """The part of `config` that describes the language model: its `text_config` when it has
    one (its quantization, dtype and model type the outer config's unless it states its
    own)."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return config
    outer = {k: config[k] for k in ("quantization_config", "torch_dtype", "dtype", "model_type")
             if config.get(k) is not None}
    return {**outer, **text}


def shape_of(config: dict[str, Any], where: str, quant: dict[str, Any] | None = None,
             source: str = "") -> ModelShape:
    """The `ModelShape` of a config dict (module doc); `where` names it in errors, `quant` is
    a quantization beside it (`quant_beside`). InputError for a model that is not MoE or a key
    the cost model needs that is missing or wrong."""
    c = language_model(config)
    kind = c.get("model_type")
    experts = _get(c, EXPERT_KEYS)
    if experts is None or c.get("enable_moe_block") is False:
        raise InputError(f"{where}: not an MoE model (model_type {kind!r}): no routed expert "
                         f"count ({' or '.join(EXPERT_KEYS)})")
    E = _count(c, EXPERT_KEYS, where, "routed experts", most=MAX_EXPERTS)
    K = _count(c, TOP_K_KEYS, where, "experts a token is routed to", most=MAX_TOP_K)
    if K > E:
        raise InputError(f"{where}: {_get(c, TOP_K_KEYS)[0]} is {K}, more than its {E} routed "
                         f"experts: a token is routed to top-k distinct experts")
    full = _count(c, HIDDEN_KEYS, where, "hidden size")
    H = _count(c, LATENT_KEYS, where, "latent size", required=False) or full
    size_keys = EXPERT_SIZE_KEYS + (("intermediate_size",) if kind in EXPERT_SIZED_TYPES else ())
    I = _count(c, size_keys, where, f"routed expert intermediate size (model_type {kind!r})")
    layers = _layer_count(c, where)
    moe = moe_layer_count(c, layers, where)
    shared, shared_I = _shared(c, kind, I, where)
    if shared and H != full:  # a latent MoE's shared expert works at the full hidden size
        shared_I = round(shared_I * full / H)
    weight = weight_dtype(c, quant, where)
    quantized = weight not in ("bf16", "fp16", "fp32")
    hashed = _count(c, HASH_LAYER_KEYS, where, "hash-routed layers", 0, False, moe) or 0
    draft = _count(c, DRAFT_LAYER_KEYS, where, "draft (MTP) layers", 0, False,
                   MAX_LAYERS) or 0
    draft_E = _count(c, DRAFT_EXPERT_KEYS, where, "draft routed experts", 1, False,
                     MAX_EXPERTS) or 0
    draft_K = _count(c, DRAFT_TOP_K_KEYS, where, "draft top-k", 1, False, draft_E or E) or 0
    return ModelShape(H, I, E, K, moe, shared_experts=shared, shared_intermediate=shared_I,
                      weight_dtype=weight, layers=layers,
                      dispatch_dtype="fp8" if quantized else "bf16",
                      source=source or where, hash_layers=hashed, draft_layers=draft,
                      draft_experts=draft_E, draft_top_k=draft_K)


def _layer_count(c: dict[str, Any], where: str) -> int:
    """The decoder layers: `LAYER_KEYS`, else the length of a per-layer list."""
    found = _count(c, LAYER_KEYS, where, "decoder layers", required=False)
    if found is not None:
        return found
    for key in ("layers_block_type", "hybrid_override_pattern", "mlp_layer_types"):
        if isinstance(c.get(key), (list, str)) and c[key]:
            return len(c[key])
    raise InputError(f"{where}: no layer count ({' or '.join(LAYER_KEYS)})")


def _int_list(c: dict[str, Any], key: str, where: str) -> list[int]:
    value = c[key]
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool)
                                              for v in value):
        raise InputError(f"{where}: {key} must be a list of integers, got {value!r:.60}")
    return value


def moe_layer_count(c: dict[str, Any], layers: int, where: str) -> int:
    """How many of the `layers` decoder layers are MoE (module doc); InputError when none is."""
    listed = {"layers_block_type": "moe", "hybrid_override_pattern": "E",
              "mlp_layer_types": "sparse"}
    count = None
    for key, mark in listed.items():
        if isinstance(c.get(key), (list, str)):
            count = list(c[key]).count(mark)
            break
    else:
        if isinstance(c.get("moe_layer_freq"), list):
            count = sum(1 for v in _int_list(c, "moe_layer_freq", where) if v)
        elif c.get("moe_layers") is not None:
            count = len({i for i in _int_list(c, "moe_layers", where) if 0 <= i < layers})
        else:
            count = sum(map(_rules(c, layers, where), range(layers)))
    if not count:
        raise InputError(f"{where}: not an MoE model: none of its {layers} layers is MoE (by "
                         f"its first_k_dense_replace, moe_layer_freq, decoder_sparse_step, "
                         f"mlp_only_layers or per-layer types)")
    return count


def _rules(c: dict[str, Any], layers: int, where: str) -> Any:
    """`is_moe(i)` of the index rules `c` states (module doc)."""
    def get(key: str, default: int, least: int = 0) -> int:
        value = c.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InputError(f"{where}: {key} must be an integer >= {least}, got {value!r}")
        return value
    first = get("first_k_dense_replace", 0)
    freq = get("moe_layer_freq", 1, 1)
    sparse = get("decoder_sparse_step", 1)
    interleave = get("interleave_moe_layer_step", 1, 1)
    start = get("moe_layer_start_index", 0)
    end = get("moe_layer_end_index", layers - 1)
    interval = get("moe_layer_interval", 1, 1)
    dense = set(_int_list(c, "mlp_only_layers", where)) if c.get("mlp_only_layers") else set()
    return lambda i: (i >= first and i % freq == 0 and sparse > 0 and (i + 1) % sparse == 0
                      and i not in dense and (i + 1) % interleave == 0 and start <= i <= end
                      and (i + 1) % interval == 0)


def _shared(c: dict[str, Any], kind: Any, I: int, where: str) -> tuple[int, int]:
    """`(shared experts, one's intermediate size)`: a size key (`SHARED_SIZE_KEYS`, one
    shared expert unless counted), else a count of experts each a routed one's size (DeepSeek),
    else the model type's (`SHARED_BY_TYPE`); `(0, 0)` when none or zero."""
    count = _count(c, SHARED_COUNT_KEYS, where, "shared experts", 0, required=False)
    size = _count(c, SHARED_SIZE_KEYS, where, "shared expert size", 0, required=False)
    if count is None and size is None:
        count = SHARED_BY_TYPE.get(kind, 0)
    if count == 0 or size == 0:
        return 0, 0
    return (1 if count is None else count), (I if size is None else size)


def weight_dtype(c: dict[str, Any], quant: dict[str, Any] | None, where: str) -> str:
    """The routed experts' weight dtype (module doc); InputError naming the key for a dtype or
    quantization eplbsim does not price."""
    nested = c.get("quantization_config") if isinstance(c.get("quantization_config"), dict) \
        else None
    value = c.get("expert_dtype")
    if value is None and nested is not None:
        value = nested.get("expert_dtype")
    if value is not None:
        if value not in EXPERT_DTYPES:
            raise InputError(f"{where}: expert_dtype {value!r} is not one eplbsim prices "
                             f"({', '.join(EXPERT_DTYPES)})")
        return EXPERT_DTYPES[value]
    q = nested if nested is not None else quant
    if q:
        return _quant_dtype(q, where)
    for key in ("torch_dtype", "dtype"):
        if c.get(key) is not None:
            if c[key] not in TORCH_DTYPES:
                raise InputError(f"{where}: {key} {c[key]!r} is not one eplbsim prices "
                                 f"({', '.join(TORCH_DTYPES)})")
            return TORCH_DTYPES[c[key]]
    return "bf16"


def _quant_dtype(q: dict[str, Any], where: str) -> str:
    """The experts' dtype a quantization object states (module doc)."""
    layers = q.get("quantized_layers") if isinstance(q.get("quantized_layers"), dict) else {}
    routed = next((v.get("quant_algo") for k, v in layers.items()
                   if ROUTED_EXPERTS.search(k) and isinstance(v, dict)), None)
    algo = q.get("quant_algo")
    named = [("moe_quant_algo", q.get("moe_quant_algo")),
             ("quantized_layers", routed),
             ("quant_algo", None if algo == "MIXED_PRECISION" else algo),
             ("config_groups", _group_algo(q.get("config_groups")))]
    method = q.get("quant_method")
    if method in ("awq", "gptq") and q.get("bits") in (4, 8):
        named.append(("bits", f"INT{q['bits']}"))
    named.append(("quant_method", method))
    for key, value in named:
        if isinstance(value, str) and value:
            dtype = next((d for pattern, d in QUANT_PATTERNS if pattern in value.upper()), None)
            if dtype is None:
                raise InputError(f"{where}: quantization {key} {value!r} is not one eplbsim "
                                 f"prices (FP8, NVFP4, MXFP4, MXFP8, INT4, INT8)")
            return dtype
    raise InputError(f"{where}: quantization_config names no quant_method or quant_algo")


def _group_algo(groups: Any) -> str | None:
    """A compressed-tensors `config_groups`' weight format as a quantization name, or None:
    4-bit floats in groups of 16 are NVFP4, of 32 MXFP4; 8-bit floats FP8; integers INTn."""
    if not isinstance(groups, dict):
        return None
    for group in groups.values():
        w = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(w, dict):
            continue
        bits, kind, size = w.get("num_bits"), w.get("type"), w.get("group_size")
        if kind == "float" and bits == 4:
            return {16: "NVFP4", 32: "MXFP4"}.get(size, f"FP4 groups of {size}")
        if kind == "float" and bits == 8:
            return "FP8"
        if kind == "int" and bits in (4, 8):
            return f"INT{bits}"
    return None
