"""Writers of the engines' log files as their tools write them, shared by the readers' tests
(tests/traces) and the hostile-input fuzz (tests/cli), which mutates one valid file of each."""

from __future__ import annotations

import json
import struct

import numpy as np

MEGATRON_LAYERS = [3, 5]  # Megatron's layer ids: need not start at 0


def write_flame_layer(path, ids: np.ndarray) -> None:
    """A FlaMoE `layer_NN.parquet`: `scores list<float16>`, `indices list<int16>`, one row a
    token (pyarrow, which the caller's test requires)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    scores = np.sort(np.random.default_rng(0).random(ids.shape), 1)[:, ::-1].astype(np.float16)
    table = pa.table({
        "scores": pa.array(list(scores), type=pa.list_(pa.float16())),
        "indices": pa.array([list(map(int, r)) for r in ids], type=pa.list_(pa.int16()))})
    pq.write_table(table, path)


def megatron_record(step, layer, rank, rows, **extra) -> dict:
    """One Megatron router-trace record of `rows` (`[T, K]` expert ids)."""
    rows = rows if isinstance(rows, list) else rows.tolist()
    return {"step": step, "stage": "pre_dispatch", "block": "decoder", "layer": layer,
            "rank": rank, "num_tokens": len(rows), "topk": 2, "top_indices": rows, **extra}


def write_jsonl(path, records):
    """`records` (dicts, or raw lines) one a line; returns `path`."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return path


def write_megatron_rank(d, rank, steps, first=0):
    """`steps[i]` `[T, L, K]` as step `first + i`, layers in reverse order, an MTP record and a
    sidecar field in every step: `router_trace_rank{rank}.jsonl` in `d`."""
    records = []
    for i, ids in enumerate(steps):
        for j in reversed(range(ids.shape[1])):
            records.append(megatron_record(first + i, MEGATRON_LAYERS[j], rank, ids[:, j],
                                           hs_offset=0))
        records.append(megatron_record(first + i, 0, rank, ids[:, 0], block="mtp", mtp_idx=0))
    return write_jsonl(d / f"router_trace_rank{rank}.jsonl", records)


def write_step_log(path, steps, stages, header=None, draft=None, draft_layer=None):
    """A per-(step, layer) JSONL router log as a vLLM-side hook writes it: an optional header
    record, then for step `s` one record a layer `{"step", "layer", "is_prefill", "topk_ids"}`
    of `steps[s]` (`[T, L, K]`), `is_prefill` from `stages[s]` ("p" or "d"); with `draft`
    (`[Td, K']` a step) one more record of layer `draft_layer` (the MTP layer, numbered after
    the decoder layers as DeepSeek's checkpoints number it) unless `draft[s]` is None."""
    records = [header] if header else []
    for s, ids in enumerate(steps):
        for layer in range(ids.shape[1]):
            records.append({"step": s, "layer": layer, "is_prefill": stages[s] == "p",
                            "topk_ids": ids[:, layer].tolist()})
        if draft is not None and draft[s] is not None:
            records.append({"step": s, "layer": draft_layer, "is_prefill": stages[s] == "p",
                            "topk_ids": draft[s].tolist()})
    return write_jsonl(path, records)


def write_sglang_token_log(path, steps, modes, draft=None):
    """A per-token JSONL log as a hook in SGLang's MoE layer writes it: record a (token, layer),
    token-major, `forward_mode` the pass's `ForwardMode` value (`modes[s]`: 1 EXTEND, 2 DECODE,
    3 MIXED), token_idx restarting each pass; with `draft` (`[T, Ld, K']` a step), each token's
    draft layers after its own, marked `"is_draft": true` (the NextN layer's)."""
    records = []
    for s, ids in enumerate(steps):
        for t, row in enumerate(ids):
            for layer, chosen in enumerate(row):
                records.append({"forward_mode": modes[s], "token_idx": t, "layer": layer,
                                "topk_ids": chosen.tolist()})
            if draft is not None:
                for layer, chosen in enumerate(draft[s][t]):
                    records.append({"forward_mode": modes[s], "token_idx": t, "layer": layer,
                                    "is_draft": True, "topk_ids": chosen.tolist()})
    return write_jsonl(path, records)


def write_safetensors(path, tensors: dict, header_extra: dict | None = None) -> None:
    """Write `{name: array}` as safetensors: u64 LE header length, JSON header (padded with
    spaces to 8 bytes, as the reference writer does), then the raw little-endian data."""
    codes = {np.dtype("<i8"): "I64", np.dtype("<i4"): "I32", np.dtype("<f4"): "F32"}
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, arr in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": codes[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    header.update(header_extra or {})
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def vllm_split(rid: str, prompt: np.ndarray, outputs: list[np.ndarray],
               created=1700000000) -> dict:
    """A vLLM v0.21 chat completion: prompt routing at the top, output routing per choice."""
    return {"id": rid, "object": "chat.completion", "created": created, "model": "m",
            "choices": [{"index": i, "message": {"role": "assistant", "content": "hi"},
                         "finish_reason": "length", "token_ids": None,
                         "routed_experts": o.tolist()} for i, o in enumerate(outputs)],
            "usage": {"prompt_tokens": len(prompt), "total_tokens": 9,
                      "completion_tokens": sum(len(o) for o in outputs)},
            "prompt_routed_experts": prompt.tolist(), "prompt_token_ids": None}
