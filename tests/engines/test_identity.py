"""A simulated rank is that rank to every channel (eplbsim.engines.identity, DESIGN.md §11):
each channel of `CHANNELS` answers, to engine code run as a rank, that rank's own identity and
notes the read; eplbsim's own code and a thread outside a rank's call see the real functions;
an exception raised in the engine's code names the engine, the rank, the file and the line.

Dimensions: `G` ranks, `N` nodes.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from eplbsim import engines
from eplbsim.base.errors import InputError
from eplbsim.dispatch.observe import watching
from eplbsim.engines import identity
from eplbsim.engines.identity import CHANNELS, FIELDS, EngineError, Identity

WHO = (Identity(0, 8, 2, tp=2), Identity(5, 8, 2, tp=2))  # two ranks of a 2-node deployment


def _adapter(engine: str):
    if engines.release(engine) is None:
        pytest.skip(f"{engine} is not fetched (eplbsim engines fetch)")
    return engines.adapter(engine)


def _reader(channel: str) -> str:
    """Python an engine writes to read `channel` (the import inside, as engine code does)."""
    engine, _, rest = channel.partition(" ")
    if channel.startswith("torch."):
        return f"{channel}()"
    if channel.startswith("os.environ"):
        return f"int({channel})"
    module = {"sglang": "sglang.srt.distributed", "vllm": "vllm.distributed"}[engine]
    if rest.startswith("get_parallel()"):
        module = "sglang.srt.runtime_context"
    call = rest if "(" in rest else f"{rest}()"
    return f"__import__({module!r}, fromlist=['_']).{call}"


def _engine_function(run, body: str):
    """A function whose code lies in `run`'s source folder (as a branch's would), returning
    `body` evaluated."""
    scope: dict = {}
    code = f"def read():\n    import os, torch\n    return {body}\n"
    exec(compile(code, str(Path(run.root) / run.engine / "branch_probe.py"), "exec"), scope)
    return scope["read"]


def _as(run, who: Identity):
    return identity.as_rank(who, run.prefix, run.label, "read")


@pytest.mark.parametrize("channel", sorted(CHANNELS))
def test_every_channel_answers_the_rank_it_runs_as(channel):
    if channel.startswith("torch.") and "distributed" not in channel:
        owner, name = channel.split(".")[1:]
        if not hasattr(getattr(torch, owner, None), name):
            pytest.skip(f"this torch has no {channel}")
    if channel == "torch.distributed.get_node_local_rank" and not hasattr(
            torch.distributed, "get_node_local_rank"):
        pytest.skip("this torch has no get_node_local_rank")
    run = _adapter("vllm" if channel.startswith("vllm") else "sglang")
    read = _engine_function(run, _reader(channel))
    field = CHANNELS[channel]
    for who in WHO:
        with run.modules.active(), _as(run, who), watching() as reads:
            got = read()
        assert got == who.value(field), (channel, who)
        if FIELDS[field][1]:  # a rank read: the probe is told which channel and where
            assert reads and reads[0][0] == channel and "branch_probe.py:3" in reads[0][1]
        else:
            assert reads == []


def test_rank_fields_are_the_ranks_own():
    who = Identity(13, 16, 2, tp=4)
    assert [who.value(f) for f in ("rank", "local_rank", "node_rank", "attn_tp_rank",
                                   "attn_dp_rank", "attn_dp_size")] == [13, 5, 1, 1, 3, 4]


def test_outside_an_engine_frame_the_real_functions_answer():
    run = _adapter("sglang")
    assert not torch.distributed.is_initialized()
    with run.modules.active(), _as(run, WHO[1]):
        assert not torch.distributed.is_initialized()  # eplbsim's own frame
        assert os.environ.get("RANK") == os.environ.real.get("RANK")
        inside = _engine_function(run, "torch.distributed.is_initialized()")()
    assert inside and not torch.distributed.is_initialized()
    assert not isinstance(os.environ, identity._Environ)
    with pytest.raises(ValueError):  # the real one: no process group here
        torch.distributed.get_rank()


def test_another_threads_engine_call_is_not_this_rank():
    run = _adapter("sglang")
    read = _engine_function(run, "torch.distributed.get_rank()")
    seen = {}

    def other():
        with run.modules.active():
            with _as(run, WHO[0]):
                seen["other"] = read()

    with _as(run, WHO[1]):
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        with run.modules.active():
            seen["mine"] = read()
    assert seen == {"other": 0, "mine": 5}


def test_a_name_imported_from_torch_distributed_answers_too():
    run = _adapter("sglang")
    scope: dict = {}
    code = ("from torch.distributed import get_rank, is_initialized\n"
            "def read():\n    return get_rank() if is_initialized() else -1\n")
    exec(compile(code, str(Path(run.root) / "sglang" / "branch_imports.py"), "exec"), scope)
    identity.rewire(scope)  # as every engine module is when it loads
    with run.modules.active(), _as(run, WHO[1]):
        assert scope["read"]() == 5


def test_an_exception_in_the_engine_names_engine_rank_function_file_and_line():
    run = _adapter("sglang")
    read = _engine_function(run, "[][3]")
    with pytest.raises(EngineError) as caught, run.modules.active(), _as(run, WHO[1]):
        read()
    text = str(caught.value)
    assert text.startswith(f"{run.label}, rank 5: the engine's code raised in read at ")
    assert "branch_probe.py:3" in text and "IndexError: list index out of range" in text


def test_an_error_of_eplbsim_around_the_call_stays_eplbsims():
    run = _adapter("sglang")
    with pytest.raises(ZeroDivisionError), _as(run, WHO[0]):
        1 / 0


def test_a_rank_read_outside_any_rank_is_refused():
    run = _adapter("sglang")
    read = _engine_function(run, "__import__('sglang.srt.runtime_context', "
                                 "fromlist=['_']).get_parallel().tp_rank")
    with pytest.raises(InputError, match="outside any simulated rank"), run.modules.active():
        read()


def test_a_setting_eplbsim_lacks_names_where_the_engine_reads_it():
    run = _adapter("sglang")
    read = _engine_function(run, "__import__('sglang.srt.runtime_context', "
                                 "fromlist=['_']).get_exec().moe.speculative_frobnicate")
    with pytest.raises(InputError) as caught, run.modules.active(), _as(run, WHO[0]):
        read()
    text = str(caught.value)
    assert "'speculative_frobnicate' at sglang/branch_probe.py:3" in text
    assert "getattr(..., default)" in text


def test_every_rank_read_in_the_fetched_releases_is_a_channel():
    """What the fetched releases' own EPLB files read of their rank (a scan of their text:
    `get_parallel().X_rank`, `get_X_group()`, `get_X_rank()`, `torch.distributed.get_X`, the
    environment's `*RANK*`) is answered by a channel, so a branch written the engine's way is
    answered too."""
    import re
    folders = [engines.release(e, v) for e, spec in engines.ENGINES.items()
               for v in spec.tested]
    folders = [f for f in folders if f is not None]
    if not folders:
        pytest.skip("no release is fetched (eplbsim engines fetch)")
    groups = {"sglang": identity.SGLANG_GROUPS, "vllm": identity.VLLM_GROUPS}
    getters = {"sglang": identity.SGLANG_GETTERS, "vllm": identity.VLLM_GETTERS}
    seen = 0
    for folder in folders:
        engine = folder.name.partition("-")[0]
        for path in folder.rglob("*.py"):
            text = path.read_text(errors="replace")
            for field in re.findall(r"get_parallel\(\)\.(\w+_rank)\b", text):
                assert field in identity.SGLANG_FIELDS, (path, field)
                seen += 1
            for group in re.findall(r"\bget_(\w+)_group\(\)", text):
                assert group in groups[engine], (path, group)
                seen += 1
            for getter in re.findall(r"\b(get_\w+_rank)\(", text):
                assert getter in getters[engine] or getter == "get_node_local_rank", (path,
                                                                                    getter)
                seen += 1
            for name in re.findall(r"(?:torch\.distributed|\bdist)\.(get_\w+)\(", text):
                if "rank" in name:
                    assert f"torch.distributed.{name}" in CHANNELS, (path, name)
                    seen += 1
            for name in re.findall(r"environ[^\n]{0,12}[\"'](\w*RANK\w*)[\"']", text):
                assert name in identity.ENVIRONMENT, (path, name)
    assert seen > 10
