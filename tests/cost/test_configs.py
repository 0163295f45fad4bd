"""A Hugging Face config.json read into a model shape (`cost.configs`), names over the built-in
table and aiconfigurator-core's shipped configs (`cost.catalog`)."""

import dataclasses
import json

import pytest

from eplbsim.base.errors import InputError
from eplbsim.cost.catalog import (closest, model_label, model_named, model_note, model_shape,
                                  shipped, trace_model)
from eplbsim.cost.configs import shape_of
from eplbsim.cost.shapes import DEFAULT_MODEL, MODELS

QWEN3_30B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
             "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
             "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
             "decoder_sparse_step": 1, "mlp_only_layers": [], "torch_dtype": "bfloat16"}
BUILT_IN_FILES = {  # built-in name -> the shipped config of the same model
    "deepseek-v3": "deepseek-ai/DeepSeek-V3", "deepseek-r1": "deepseek-ai/DeepSeek-R1",
    "kimi-k2": "moonshotai/Kimi-K2-Instruct", "glm-5": "zai-org/GLM-5",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B", "qwen3-235b-a22b": "Qwen/Qwen3-235B-A22B",
    "qwen3-coder-480b-a35b": "Qwen/Qwen3-Coder-480B-A35B-Instruct",
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1", "mixtral-8x22b": "mistralai/Mixtral-8x22B-v0.1",
    "gpt-oss-120b": "openai/gpt-oss-120b", "gpt-oss-20b": "openai/gpt-oss-20b",
    "llama-4-scout": "meta-llama/Llama-4-Scout-17B-16E-Instruct",
    "llama-4-maverick": "meta-llama/Llama-4-Maverick-17B-128E-Instruct",
    "minimax-m2.5": "MiniMaxAI/MiniMax-M2.5",
    "deepseek-v4-flash": "deepseek-ai/DeepSeek-V4-Flash",
    "deepseek-v4-pro": "deepseek-ai/DeepSeek-V4-Pro"}
# DeepSeek-V4.1-Flash's config.json @ dba1be0a40aa45a94ad051997016db3960a90277, the keys the
# shape reads (as an mlx-lm port's deepseek_v41 config test quotes it): the text model under
# `text_config`, `expert_dtype` under `quantization_config`, a DSpark draft of its own experts
DEEPSEEK_V41_FLASH = {
    "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
    "dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                            "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
                            "expert_dtype": "fp4"},
    "text_config": {"model_type": "deepseek_v41_text", "vocab_size": 129280,
                    "hidden_size": 5120, "moe_intermediate_size": 2304,
                    "num_hidden_layers": 40, "n_routed_experts": 384, "n_shared_experts": 1,
                    "num_experts_per_tok": 6, "topk_method": "noaux_tc",
                    "num_nextn_predict_layers": 3, "dspark_n_routed_experts": 128,
                    "dspark_num_experts_per_tok": 3}}
needs_shipped = pytest.mark.skipif(not shipped(), reason="aiconfigurator-core not installed")


def _shape(config: dict, **changes) -> object:
    return shape_of({**config, **changes}, "config.json")


def test_a_qwen3_config_gives_its_shape():
    s = _shape(QWEN3_30B)
    assert (s.hidden, s.intermediate, s.experts, s.top_k, s.moe_layers, s.layers) == \
        (2048, 768, 128, 8, 48, 48)
    assert (s.shared_experts, s.weight_dtype, s.dispatch_dtype) == (0, "bf16", "bf16")
    assert s == dataclasses.replace(MODELS["qwen3-30b-a3b"], source="config.json")


@pytest.mark.parametrize("changes, moe", [
    ({"first_k_dense_replace": 3, "moe_layer_freq": 1}, 45),
    ({"first_k_dense_replace": 1, "moe_layer_freq": 2}, 23),  # layers 2, 4, .., 46
    ({"decoder_sparse_step": 2}, 24), ({"mlp_only_layers": [0, 5, 47]}, 45),
    ({"interleave_moe_layer_step": 2}, 24),
    ({"moe_layer_start_index": 1, "moe_layer_end_index": 40, "moe_layer_interval": 1}, 40),
    ({"moe_layer_freq": [0, 1] * 24}, 24), ({"moe_layers": [1, 3, 99]}, 2),
    ({"mlp_layer_types": ["dense"] * 3 + ["sparse"] * 45}, 45),
    ({"hybrid_override_pattern": "MEM*E" * 4}, 8)])
def test_which_layers_are_moe_follows_each_rule(changes, moe):
    assert _shape(QWEN3_30B, **changes).moe_layers == moe


@pytest.mark.parametrize("changes, dtype, nbytes", [
    ({"quantization_config": {"quant_method": "fp8"}}, "fp8", 1),
    ({"quantization_config": {"quant_method": "mxfp4"}}, "mxfp4", 0.5 + 1 / 32),
    ({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}, "nvfp4",
     0.5 + 1 / 16),
    ({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"g": {
        "weights": {"num_bits": 4, "type": "float", "group_size": 16}}}}}, "nvfp4", 0.5625),
    ({"quantization_config": {"quant_algo": "MIXED_PRECISION", "quantized_layers": {
        "model.layers.0.mlp.shared_expert.up_proj": {"quant_algo": "FP8"},
        "model.layers.0.mlp.experts.0.up_proj": {"quant_algo": "W4A16_NVFP4"}}}}, "nvfp4", None),
    ({"expert_dtype": "fp4", "quantization_config": {"quant_method": "fp8"}}, "fp4", 0.5),
    ({"torch_dtype": "float16"}, "fp16", 2), ({"torch_dtype": None, "dtype": "float32"}, "fp32", 4),
    ({"torch_dtype": None}, "bf16", 2)])
def test_the_experts_weight_dtype_may_be_fractional_bytes(changes, dtype, nbytes):
    s = _shape(QWEN3_30B, **changes)
    assert s.weight_dtype == dtype
    if nbytes is not None:
        assert s.bytes_of("weight") == nbytes
        assert s.expert_weight_bytes == int(3 * 2048 * 768 * nbytes)  # whole bytes, an int


def test_shared_experts_nested_text_config_and_latent_size():
    deepseek = dict(QWEN3_30B, n_routed_experts=256, n_shared_experts=1, num_experts=None)
    assert (_shape(deepseek).shared_experts, _shape(deepseek).shared_intermediate) == (1, 768)
    qwen2 = dict(QWEN3_30B, shared_expert_intermediate_size=5632)
    assert (_shape(qwen2).shared_experts, _shape(qwen2).shared_intermediate) == (1, 5632)
    assert _shape(QWEN3_30B, shared_expert_intermediate_size=0).shared_experts == 0
    outer = {"model_type": "qwen3_vl_moe", "text_config": QWEN3_30B,
             "quantization_config": {"quant_method": "fp8"}}
    assert _shape(outer).experts == 128 and _shape(outer).weight_dtype == "fp8"
    latent = _shape(QWEN3_30B, moe_latent_size=512, n_shared_experts=1,
                    moe_shared_expert_intermediate_size=1000)
    assert (latent.hidden, latent.shared_intermediate) == (512, 4000)  # shared at full H


@pytest.mark.parametrize("changes, words", [
    ({"num_experts": None}, r"config.json: not an MoE model \(model_type 'qwen3_moe'\): no "
                            r"routed expert count \(n_routed_experts or num_experts"),
    ({"num_experts": -3}, "config.json: num_experts must be an integer >= 1"),
    ({"num_experts": 12.5}, "num_experts must be an integer >= 1 .*got 12.5"),
    ({"num_experts_per_tok": None}, "no experts a token is routed to .*num_experts_per_tok"),
    ({"num_experts_per_tok": 200}, "num_experts_per_tok is 200, more than its 128 routed "
                                   "experts"),
    ({"num_experts": int("9" * 400)}, "num_experts is a 400-digit number .*above the cap"),
    ({"moe_intermediate_size": None}, "no routed expert intermediate size .*qwen3_moe"),
    ({"hidden_size": "big"}, "hidden_size must be an integer"),
    ({"enable_moe_block": False}, "not an MoE model"),
    ({"decoder_sparse_step": 0}, "none of its 48 layers is MoE"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quant_method 'bitsandbytes'"),
    ({"torch_dtype": "int3"}, "torch_dtype 'int3' is not one")])
def test_a_bad_config_is_one_line_naming_the_key(changes, words):
    with pytest.raises(InputError, match=words) as err:
        _shape(QWEN3_30B, **changes)
    assert "\n" not in str(err.value)


def test_hash_and_draft_layers_are_read_from_any_config():
    v4 = _shape(QWEN3_30B, num_hash_layers=3, num_nextn_predict_layers=1)
    assert (v4.hash_layers, v4.draft_layers, v4.draft_experts, v4.draft_top_k) == (3, 1, 0, 0)
    assert (_shape(QWEN3_30B).hash_layers, _shape(QWEN3_30B).draft_layers) == (0, 0)
    v41 = shape_of(DEEPSEEK_V41_FLASH, "config.json")
    assert dataclasses.replace(v41, source="") == dataclasses.replace(
        MODELS["deepseek-v4.1-flash"], source="")
    assert (v41.draft_layers, v41.draft_experts, v41.draft_top_k, v41.hash_layers) == \
        (3, 128, 3, 0)
    assert v41.weight_dtype == "fp4"  # the nested expert_dtype, not quant_method fp8
    for changes, words in (({"num_hash_layers": 49}, "num_hash_layers is 49 .*above the cap "
                                                      "of 48"),
                           ({"num_hash_layers": -1}, "num_hash_layers must be an integer >= 0"),
                           ({"dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 5},
                            "dspark_num_experts_per_tok is 5 .*above the cap of 4")):
        with pytest.raises(InputError, match=words):
            _shape(QWEN3_30B, **changes)


def test_every_deepseek_v4_layer_is_moe_and_the_first_three_hashed():
    for key, (E, L) in (("deepseek-v4-flash", (256, 43)), ("deepseek-v4-pro", (384, 61))):
        shape = MODELS[key]
        assert (shape.experts, shape.top_k, shape.moe_layers, shape.layers) == (E, 6, L, L)
        assert (shape.hash_layers, shape.draft_layers) == (3, 1)
    assert MODELS["deepseek-v4-pro"].hidden == 7168
    assert model_named("deepseek-ai/DeepSeek-V4-Flash") == "deepseek-v4-flash"
    assert model_named("DeepSeek-V4.1-Flash") == "deepseek-v4.1-flash"
    with pytest.raises(InputError, match="hash_layers .*at most its 2"):
        dataclasses.replace(MODELS["deepseek-v4-flash"], moe_layers=2, layers=2)


def test_a_config_file_is_read_safely(tmp_path):
    (tmp_path / "list.json").write_text("[1]")
    (tmp_path / "bad.json").write_text("{not json")
    for name, words in (("list.json", "one JSON object, got list"),
                        ("bad.json", "not a JSON config"), ("none.json", "no such file")):
        with pytest.raises(InputError, match=words):
            model_shape(tmp_path / name)
    folder = tmp_path / "snap"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN3_30B))
    (folder / "hf_quant_config.json").write_text(json.dumps(
        {"quantization": {"quant_algo": "NVFP4"}}))  # ModelOpt's, beside the config
    assert model_shape(str(folder)).weight_dtype == "nvfp4"
    assert model_label(str(folder)) == str(folder)


def test_names_notes_and_the_trace_model():
    assert model_named("Qwen/Qwen3-30B-A3B") == "qwen3-30b-a3b"
    assert model_named("ALLENAI/OLMoE-1B-7B-0924-Instruct") == "olmoe-1b-7b"
    assert "qwen3-30b-a3b" in closest("qwen3-30b-a4b")
    assert trace_model({"model_id": "Qwen/Qwen1.5-MoE-A2.7B-Chat"}, 60, 4) == "qwen1.5-moe-a2.7b"
    assert trace_model({"served_model_name": "mine"}, 60, 4) == DEFAULT_MODEL
    note = model_note("deepseek-v3", MODELS["deepseek-v3"],
                      "the default: the trace names no model", 60, 4)
    assert note == ("model deepseek-v3 (the default: the trace names no model) has 256 "
                    "experts, top-8; the trace has E=60, K=4: its loads are priced as that "
                    "model's; name the model with model=NAME|config.json")  # Python's spelling
    assert model_note("deepseek-v3", MODELS["deepseek-v3"], "given", 256, 8) is None
    with pytest.raises(InputError, match=r"unknown model 'qwen3-30b-a4b' \(did you mean "):
        model_shape("qwen3-30b-a4b")


@needs_shipped
def test_every_shipped_config_parses_or_is_refused_as_not_moe():
    moe = 0
    for name, path in shipped().items():
        try:
            s = model_shape(str(path))
        except InputError as err:
            assert "not an MoE model" in str(err) and path.name in str(err), name
            continue
        moe += 1
        assert min(s.experts, s.top_k, s.hidden, s.intermediate, s.moe_layers) >= 1, name
        assert s.layers >= s.moe_layers, name
    assert moe >= 60


@needs_shipped
@pytest.mark.parametrize("key", sorted(BUILT_IN_FILES))
def test_each_built_in_shape_is_its_shipped_config(key):
    assert model_named(BUILT_IN_FILES[key].lower()) is not None
    parsed = model_shape(str(shipped()[BUILT_IN_FILES[key]]))
    assert dataclasses.replace(parsed, source="") == dataclasses.replace(MODELS[key], source="")


@needs_shipped
@pytest.mark.parametrize("name, key", [
    ("Qwen/Qwen3-30B-A3B", "qwen3-30b-a3b"), ("Kimi-K2-Instruct", "moonshotai/Kimi-K2-Instruct"),
    ("qwen3-30b-a3b-fp8", "Qwen/Qwen3-30B-A3B-FP8"), ("kimi-k2.5", "moonshotai/Kimi-K2.5"),
    ("QWEN3-VL-30B-A3B-Instruct-AWQ", "Qwen/Qwen3-VL-30B-A3B-Instruct")])
def test_names_resolve_over_shipped_configs(name, key):
    assert model_named(name) == key
    assert model_shape(name).experts >= 1


def test_the_repositorys_qwen3_config_is_the_built_in_shape():
    """`traces/models/qwen3-30b-a3b/config.json`, which the guides price the real Qwen3 log
    with, reads (as a file and as its folder) to the built-in qwen3-30b-a3b but its source."""
    from pathlib import Path
    folder = Path(__file__).resolve().parents[2] / "traces" / "models" / "qwen3-30b-a3b"
    for given in (folder / "config.json", folder):
        shape = model_shape(str(given))
        assert dataclasses.replace(shape, source="") == dataclasses.replace(
            MODELS["qwen3-30b-a3b"], source="")
