"""Import vLLM's per-request routed experts (`--enable-return-routed-experts`) as a RequestSet.

Dimensions: `R` requests, `n` token rows of a request (prompt rows, then output rows), `L` MoE
layers, `K` top-k, `E` logical experts.

vLLM returns, for every token it ran through the model, the `[L, K]` logical expert ids each
MoE layer's router chose (`-1` is kept as padding). Two forms are read:

**JSON, as the OpenAI-compatible server returns it** (`/v1/completions`, `/v1/chat/completions`):
a file holding one response object, a JSON list of them, or JSONL with one per line (blank
lines skipped). A line may also be a line of vLLM's batch output file, `{"id", "custom_id",
"response": {"status_code", "request_id", "body": <response>}, "error"}`
(`vllm/entrypoints/openai/batch/protocol.py` at vllm-project/vllm
479eabf25ccf25ff994ad0a129d77c8e3da27f92); its request id is then `custom_id`. The routing
sits in one of the two layouts vLLM has shipped:

- *split* (vLLM v0.21, docs.vllm.ai/en/v0.21.0/training/routed_experts_replay): the response
  carries `prompt_routed_experts [prompt_len][L][K]` at the top level (shared by its choices)
  and each choice `routed_experts [gen_len][L][K]`, nested lists of int16 ids; the prompt rows
  are the response's, the output rows the choice's.
- *combined* (vLLM main: `CompletionResponseChoice` / `ChatCompletionResponseChoice` in
  `vllm/entrypoints/openai/{completion,chat_completion}/protocol.py` at vllm-project/vllm
  002032ee2b18e1f7bd924ec47b62504ba3866063): no `prompt_routed_experts`; each choice's
  `routed_experts` is a base64-encoded `.npy` of shape `[num_tokens - 1, L, K]`, the prompt's
  rows followed by the output's (the last sampled token never ran, so it has no row; a request
  with `routed_experts_prompt_start=s` omits the first `s` prompt rows). The output row count
  is the choice's generated tokens - 1, generated tokens counted by its `token_ids`
  (`return_token_ids`) or, for a one-choice response, `usage.completion_tokens`; the rest are
  the prompt's, at most `usage.prompt_tokens` when usage is there.

Either field may be nested lists or a base64 `.npy` string in either layout (the `.npy` is
read with `allow_pickle=False`). Each choice is one request (the choices of an `n > 1`
response each repeat its prompt rows), named by the response's `id` (`custom_id` for a batch
line), with `/{index}` appended when the response has several choices. Requests keep file
order and carry no arrival: vLLM's `created` is whole Unix seconds, not a step, so it is kept
in `meta["created"]` (one entry per request, None where absent); the first model a response
names (`model`, `model_id`, ...: `trace.MODEL_KEYS`) is `meta["model"]`.

**Arrays, one file per request** in a directory, in natural name order (`r2` before `r10`),
each named by its file's stem; other files are ignored:

- `.npz` with `prompt_routed_experts [p, L, K]` and/or `routed_experts [g, L, K]` (the split
  layout, as `RequestOutput.prompt_routed_experts` and `CompletionOutput.routed_experts` hold
  them), or with `routed_experts [n, L, K]` and a 0-d integer `prompt_len` (the combined
  layout: its first `prompt_len` rows are the prompt's);
- `.npy` `[n, L, K]`: a combined-layout payload as decoded (`base64.b64decode(routed_experts)`
  written to a file); the prompt length of every `.npy` is the `prompt_len` option.

Anything malformed (not JSON, a missing or ragged field, non-integer ids, an id outside
`[-1, E)`, an expert twice in a token's layer, rows that do not fit the token counts, an `.npy`
whose header declares more data than follows it) is an InputError naming the file and the
record (`file:line` in JSONL, `record i` in a JSON list, the file itself for one object or one
array file) and, where there is one, the choice.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import json
import re
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from ...base.errors import InputError
from ...base.files import (NPY_HEADER, NPY_HEADER_ERRORS, npy_header, npy_refusal, regular_file,
                           size_text)
from ...base.limits import MAX_EXPERTS
from ..directory import TRACE_FILES
from ...base.options import option
from ..requests import RequestSet, requests_of
from ..trace import check_distinct, model_in

_ARRAY_SUFFIXES = (".npy", ".npz")
_PROMPT, _ROUTED = "prompt_routed_experts", "routed_experts"
_KINDS = {np.ndarray: ".npy array", np.lib.npyio.NpzFile: ".npz archive"}


def is_vllm_json(path: Path) -> bool:
    """Whether `path` is a `.json` file, or a `.jsonl` file's first record, naming `"choices"`
    (an OpenAI-style response, which router logs and other JSON never hold): read in chunks,
    however long the routing before the key (a long prompt's ids come first)."""
    suffix = path.suffix.lower()
    if suffix not in (".json", ".jsonl") or not path.is_file():
        return False
    key, tail = b'"choices"', b""
    try:
        with open(path, "rb") as f:
            if suffix == ".jsonl":
                first = next((line for line in f if line.strip()), b"")
                return key in first
            while chunk := f.read(1 << 20):
                if key in tail + chunk:
                    return True
                tail = chunk[-len(key):]  # a key across two chunks
    except OSError:
        return False
    return False


def is_vllm_arrays(path: Path) -> bool:
    """Whether `path` is a directory of per-request `.npy` / `.npz` files (and not an eplbsim
    trace directory, whole or missing a file: one holding any of `TRACE_FILES`)."""
    return path.is_dir() and not any((path / name).exists() for name in TRACE_FILES) and any(
        p.suffix.lower() in _ARRAY_SUFFIXES and p.is_file() for p in path.iterdir())


# -- JSON ---------------------------------------------------------------------------------------

def read_vllm_json(path: Path, *, experts: int | None = None) -> RequestSet:
    """vLLM OpenAI-server responses (module doc) as a RequestSet; `experts` defaults to the
    largest id + 1."""
    path = Path(path)
    names, prompts, arrays, created, models = [], [], [], [], []
    for where, record in _records(path):
        for name, prompt_len, ids, stamp, model in _requests_of_record(record, where, experts):
            names.append(name)
            prompts.append(prompt_len)
            arrays.append(ids)
            created.append(stamp)
            models.append(model)
    meta = {"source": "vllm", "format": "openai-json", "file": str(path), "created": created}
    named = next((m for m in models if isinstance(m, str)), None)
    if named is not None:  # the served model, as the responses name it
        meta["model"] = named
    return _request_set(path, arrays, prompts, names, experts, meta)


def _records(path: Path) -> list[tuple[str, Any]]:
    """`(where, record)` of each response in the file: one object, a list, or JSONL."""
    try:
        with open(regular_file(path, "vLLM response file"), encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text ({exc})") from None
    try:
        whole = json.loads(text)
    except RecursionError:
        raise InputError(f"{path}: JSON nested too deeply") from None
    except ValueError as exc:
        return _jsonl(path, text, exc)
    if isinstance(whole, list):
        if not whole:
            raise InputError(f"{path}: an empty list holds no responses")
        return [(f"{path}: record {i}", r) for i, r in enumerate(whole)]
    return [(str(path), whole)]


def _jsonl(path: Path, text: str, whole_error: ValueError) -> list[tuple[str, Any]]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((f"{path}:{n}", json.loads(line)))
        except (ValueError, RecursionError) as exc:
            if not out:  # not JSONL either: the whole-document error says where it broke
                raise InputError(f"{path}: not valid JSON or JSONL ({whole_error})") from None
            raise InputError(f"{path}:{n}: not valid JSON ({exc})") from None
    if not out:
        raise InputError(f"{path}: holds no responses")
    return out


def _requests_of_record(record: Any, where: str, experts: int | None
                        ) -> list[tuple[str, int, np.ndarray, int | None, Any]]:
    """`(name, prompt_len, ids [n, L, K], created, model)` of each choice of one response
    (`model`: the one the response names, `trace.model_in`, or None)."""
    if not isinstance(record, dict):
        raise InputError(f"{where}: a response must be a JSON object")
    body, name = record, record.get("id")
    if "custom_id" in record and "response" in record:  # a line of a batch output file
        name, response = record["custom_id"], record["response"]
        if record.get("error") is not None or not isinstance(response, dict) \
                or not isinstance(response.get("body"), dict):
            raise InputError(f"{where}: batch request {name!r} has no response body (error: "
                             f"{record.get('error')!r})")
        body = response["body"]
    if not isinstance(name, str) or not name:
        raise InputError(f"{where}: the response has no id")
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or \
            not all(isinstance(c, dict) for c in choices):
        raise InputError(f"{where}: choices must be a non-empty list of objects")
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
    created = body.get("created")
    created = created if isinstance(created, int) and not isinstance(created, bool) else None
    split = body.get(_PROMPT) is not None
    prompt = _ids(body[_PROMPT], f"{where}: {_PROMPT}", experts) if split else None
    out = []
    for i, choice in enumerate(choices):
        index = choice.get("index", i)
        what = f"{where}: choice {index}"
        rows = choice.get(_ROUTED)
        if rows is None and not split:
            raise InputError(f"{what} has no {_ROUTED} (was the server started with "
                             f"--enable-return-routed-experts?)")
        ids = None if rows is None else _ids(rows, f"{what} {_ROUTED}", experts)
        if split:
            parts = [p for p in (prompt, ids) if p is not None]
            if len(parts) == 2 and parts[0].shape[1:] != parts[1].shape[1:]:
                raise InputError(f"{what}: {_ROUTED} rows are [layers, top_k] = "
                                 f"{list(parts[1].shape[1:])}, {_PROMPT} rows "
                                 f"{list(parts[0].shape[1:])}")
            prompt_len = 0 if prompt is None else prompt.shape[0]
            ids = np.concatenate(parts) if parts else None
        else:
            prompt_len = _combined_prompt_len(choice, usage, len(choices), ids, what)
        if ids is None:
            raise InputError(f"{what}: no routed rows")
        out.append((name if len(choices) == 1 else f"{name}/{index}", prompt_len, ids, created,
                    model_in(body)))
    return out


def _combined_prompt_len(choice: dict, usage: dict, num_choices: int, ids: np.ndarray | None,
                         what: str) -> int:
    """The prompt rows of a combined-layout choice: its rows less (generated tokens - 1)."""
    tokens = choice.get("token_ids")
    generated = len(tokens) if isinstance(tokens, list) else \
        usage.get("completion_tokens") if num_choices == 1 else None
    if not isinstance(generated, int) or isinstance(generated, bool) or generated < 0:
        raise InputError(f"{what}: cannot tell prompt rows from output rows: it needs "
                         f"token_ids (request return_token_ids) or, with one choice, "
                         f"usage.completion_tokens")
    rows = 0 if ids is None else ids.shape[0]
    prompt_len = rows - max(generated - 1, 0)
    bound = usage.get("prompt_tokens")
    if prompt_len < 0 or (isinstance(bound, int) and prompt_len > bound):
        raise InputError(f"{what}: {rows} routed rows do not fit {generated} generated tokens "
                         f"after a prompt of {bound if isinstance(bound, int) else '?'} "
                         f"tokens (a combined {_ROUTED} has prompt rows + generated - 1)")
    return prompt_len


def _ids(value: Any, what: str, experts: int | None) -> np.ndarray | None:
    """Routed ids `[n, L, K]` (int32) from nested lists or a base64 `.npy`; None for no rows."""
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise InputError(f"{what}: not base64 (an encoded .npy was expected)") from None
        arr = _load(io.BytesIO(raw), what, np.ndarray)
    elif isinstance(value, list):
        if not value:
            return None
        try:
            arr = np.asarray(value)
        except (ValueError, TypeError, OverflowError):
            raise InputError(f"{what}: ragged lists; expected [tokens][layers][top_k] "
                             f"integers") from None
        if arr.dtype.kind in "iu" and arr.ndim == 3 and any(
                type(x) is bool for t in value for r in t for x in r):  # numpy took them as 1, 0
            raise InputError(f"{what}: ids must be integers; true and false are not expert ids")
    else:
        raise InputError(f"{what}: expected nested lists or a base64 .npy string, got "
                         f"{type(value).__name__}")
    return _checked(arr, what, experts)


def _declared_fits(source: io.BytesIO | Path, what: str) -> None:
    """InputError when the .npy `source` (bytes, left at their start, or a file) declares more
    data than follows its header: a header may claim any shape, which numpy would allocate
    before finding the bytes missing. A header numpy cannot read is left for np.load to
    refuse."""
    with contextlib.nullcontext(source) if isinstance(source, io.BytesIO) else \
            open(source, "rb") as f:
        try:
            shape, _, _, nbytes = npy_header(f)
            data = f.tell()
            held = f.seek(0, io.SEEK_END) - data
        except NPY_HEADER_ERRORS:
            return
        finally:
            f.seek(0)
    if nbytes > held:
        raise InputError(f"{what}: its .npy header declares shape {list(shape)}, "
                         f"{size_text(nbytes)}, but {size_text(held)} follow it (truncated or "
                         f"corrupt?)")


def _load(source: Any, what: str, kind: type) -> Any:
    """`np.load(source)` without unpickling; InputError unless it gives a `kind`, or when an
    .npy declares more data than it holds (`_declared_fits`)."""
    if kind is np.ndarray:
        _declared_fits(source, what)
    try:
        out = np.load(source, allow_pickle=False, max_header_size=NPY_HEADER)
    except (*NPY_HEADER_ERRORS, zipfile.BadZipFile, zlib.error) as exc:
        raise InputError(f"{what}: not a readable {_KINDS[kind]} ({npy_refusal(exc)})") from None
    if not isinstance(out, kind):
        if isinstance(out, np.lib.npyio.NpzFile):
            out.close()
        raise InputError(f"{what}: not a {_KINDS[kind]} (numpy read a {type(out).__name__})")
    return out


def _checked(arr: np.ndarray, what: str, experts: int | None) -> np.ndarray | None:
    """`arr` as int32 `[n, L, K]` after checking its shape and ids (their range before any
    cast, and no expert twice in a token's layer)."""
    if arr.dtype.kind not in "iu" or arr.ndim != 3:
        raise InputError(f"{what}: expected integers [tokens, layers, top_k], got dtype "
                         f"{arr.dtype} and shape {list(arr.shape)}")
    if arr.shape[0] == 0:
        return None
    limit = MAX_EXPERTS if experts is None else experts
    lo, hi = int(arr.min()), int(arr.max())
    if lo < -1 or hi >= limit:
        raise InputError(f"{what}: expert id {lo if lo < -1 else hi} outside [-1, {limit})")
    ids = arr.astype(np.int32)
    check_distinct(ids, what)
    return ids


def _request_set(path: Path, arrays: list[np.ndarray], prompts: list[int], names: list[str],
                 experts: int | None, meta: dict) -> RequestSet:
    E = experts if experts is not None else max(1, max(int(a.max()) for a in arrays) + 1)
    try:
        return requests_of(arrays, prompts, E, None, names, meta)
    except InputError as exc:
        raise InputError(f"{path}: {exc}") from None


# -- arrays -------------------------------------------------------------------------------------

def read_vllm_arrays(path: Path, *, experts: int | None = None,
                     prompt_len: int | None = None) -> RequestSet:
    """A directory of per-request `.npy` / `.npz` files (module doc) as a RequestSet;
    `prompt_len` is every `.npy` file's prompt length, `experts` defaults to the largest
    id + 1."""
    path = Path(path)
    if prompt_len is not None and (isinstance(prompt_len, bool) or
                                   not isinstance(prompt_len, int) or prompt_len < 0):
        raise InputError(f"prompt_len must be a non-negative integer, got {prompt_len!r}")
    files = sorted((p for p in path.iterdir()
                    if p.suffix.lower() in _ARRAY_SUFFIXES and p.is_file()),
                   key=lambda p: [int(s) if s.isdigit() else s
                                  for s in re.split(r"(\d+)", p.name)])
    if not files:
        raise InputError(f"{path}: no .npy or .npz files")
    prompts, arrays = [], []
    for f in files:
        p, ids = _read_npy(f, experts, prompt_len) if f.suffix.lower() == ".npy" else \
            _read_npz(f, experts)
        prompts.append(p)
        arrays.append(ids)
    meta = {"source": "vllm", "format": "arrays", "directory": str(path),
            "files": [f.name for f in files]}
    return _request_set(path, arrays, prompts, [f.stem for f in files], experts, meta)


def _read_npy(path: Path, experts: int | None, prompt_len: int | None
              ) -> tuple[int, np.ndarray]:
    if prompt_len is None:
        raise InputError(f"{path}: an .npy holds a request's prompt and output rows together, "
                         f"and nothing says where its prompt ends: give the prompt's rows with "
                         f"{option('prompt_len', 'N')}, or write each request as an "
                         f".npz with {_PROMPT} and {_ROUTED}")
    arr = _load(regular_file(path, ".npy file"), str(path), np.ndarray)
    ids = _nonempty(path, _checked(arr, str(path), experts))
    if prompt_len > ids.shape[0]:
        raise InputError(f"{path}: prompt_len={prompt_len} exceeds its {ids.shape[0]} rows")
    return prompt_len, ids


def _read_npz(path: Path, experts: int | None) -> tuple[int, np.ndarray]:
    try:
        with _load(regular_file(path, ".npz file"), str(path), np.lib.npyio.NpzFile) as z:
            arrays = {k: z[k] for k in (_PROMPT, _ROUTED, "prompt_len") if k in z.files}
    except InputError:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        why = "it holds Python objects, which eplbsim never unpickles" \
            if "pickle" in str(exc) else exc
        raise InputError(f"{path}: not a readable .npz archive ({why})") from None
    if _PROMPT not in arrays and _ROUTED not in arrays:
        raise InputError(f"{path}: holds neither {_PROMPT} nor {_ROUTED}")
    parts = {k: _checked(arrays[k], f"{path}: {k}", experts) for k in (_PROMPT, _ROUTED)
             if k in arrays}
    if "prompt_len" not in arrays:
        kept = [a for a in parts.values() if a is not None]
        if len(kept) == 2 and kept[0].shape[1:] != kept[1].shape[1:]:
            raise InputError(f"{path}: {_PROMPT} rows are {list(kept[0].shape[1:])} but "
                             f"{_ROUTED} rows {list(kept[1].shape[1:])} ([layers, top_k])")
        prompt = parts.get(_PROMPT)
        return (0 if prompt is None else prompt.shape[0],
                _nonempty(path, np.concatenate(kept) if kept else None))
    if _PROMPT in parts or _ROUTED not in parts:
        raise InputError(f"{path}: prompt_len goes with {_ROUTED} alone (the combined layout), "
                         f"not with {_PROMPT}")
    p = arrays["prompt_len"]
    ids = _nonempty(path, parts[_ROUTED])
    if p.ndim != 0 or p.dtype.kind not in "iu" or not 0 <= int(p) <= ids.shape[0]:
        raise InputError(f"{path}: prompt_len must be a 0-d integer in [0, {ids.shape[0]}], "
                         f"got {p!r}")
    return int(p), ids


def _nonempty(path: Path, ids: np.ndarray | None) -> np.ndarray:
    if ids is None:
        raise InputError(f"{path}: holds no routed rows")
    return ids
