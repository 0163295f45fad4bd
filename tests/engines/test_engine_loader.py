"""The loader that tolerates engine versions (`eplbsim.engines.standins`, `sglang_runtime`,
`source.call`): inert stand-ins that fail only when used, real files before stand-ins, one
settings object for every historical shape, entry points called by their signatures. Made-up
engine packages in a temporary folder; no engine needs to be fetched."""

from __future__ import annotations

import textwrap

import pytest

from eplbsim.base.errors import InputError
from eplbsim.engines.sglang_runtime import MissingSetting, Settings, modules
from eplbsim.engines.source import Modules, call
from eplbsim.engines.standins import Inert


def _package(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


@pytest.fixture
def engine(tmp_path):
    """A made-up engine `eng`: an EPLB module importing a missing module, a module that needs
    the serving stack, a real helper, and a settings module the adapter supplies."""
    root = _package(tmp_path, {
        "eng/__init__.py": "raise RuntimeError('the serving stack')\n",
        "eng/eplb/dispatch.py": """
            from eng.utils.logging import init_logger, flag
            from eng.heavy import Engine
            from eng.helpers import double
            from eng.config import settings

            logger = init_logger(__name__)

            class Info(Engine):
                pass

            @flag
            def choose(x):
                return double(x) + settings.offset

            def uses_the_stand_in():
                return 1 if logger.enabled else 0
        """,
        "eng/heavy.py": "import not_installed_anywhere\nclass Engine: pass\n",
        "eng/helpers.py": "def double(x):\n    return 2 * x\n",
    })
    config = __import__("types").ModuleType("eng.config")
    config.settings = __import__("types").SimpleNamespace(offset=1)
    return Modules(root, "eng", {"eng.config": config}, "eng 1.0")


def test_missing_and_unloadable_imports_stand_in_and_real_files_load(engine):
    mod = engine.load("eng.eplb.dispatch")
    with engine.active():
        assert mod.choose(3) == 7  # the real helper, the supplied settings, the decorator inert
        assert issubclass(mod.Info, object) and mod.Info(1, key=2) is not None
    stood = engine.stood
    assert stood["eng.utils.logging"] == "the engine source lacks it"
    assert stood["eng.heavy"].startswith("it does not load without the serving stack: "
                                         "ModuleNotFoundError")
    assert "eng.helpers" not in stood


def test_a_stand_in_fails_naming_itself_only_when_its_value_is_used(engine):
    mod = engine.load("eng.eplb.dispatch")
    with engine.active(), pytest.raises(InputError, match=(
            r"eng 1\.0 used eng\.utils\.logging\.init_logger\(\.\.\.\)\.enabled, which eplbsim "
            r"stands in for \(the engine source lacks it\)")):
        mod.uses_the_stand_in()
    inert = Inert("x.y", "why", "eng")
    assert isinstance(inert.a.b(1, k=2), Inert)  # attributes and calls stay inert
    for use in (bool, int, len, iter, lambda v: v + 1, lambda v: v[0], lambda v: v == 1):
        with pytest.raises(InputError, match="used x.y"):
            use(inert)


def test_the_settings_answer_every_shape_a_release_read_them_in():
    s = Settings("sglang 0.5.16")
    s.ep_size, s.moe_a2a_backend = 8, "deepep"
    runtime = modules(s)
    rc, args, batch = (runtime[n] for n in ("sglang.srt.runtime_context",
                                             "sglang.srt.server_args",
                                             "sglang.srt.managers.schedule_batch"))
    assert rc.get_parallel().ep_size == rc.get_exec().moe.ep_size == 8
    assert rc.get_server_args().ep_size == args.get_global_server_args().ep_size == 8
    assert batch.global_server_args_dict["ep_size"] == 8 and s.enable_deepep_moe
    assert rc.get_device().device == "cpu" and rc.get_resources().lplb_solvers == {}
    with pytest.raises(MissingSetting, match="sglang 0.5.16 read the setting 'speculative'"):
        rc.get_exec().moe.speculative
    assert getattr(s, "speculative", "default") == "default"  # the engine's own defaults hold


def test_entry_points_are_called_by_their_signatures():
    def old(server_args, model_config, physical_to_logical_map, moe_ep_rank=None):
        return server_args, model_config, physical_to_logical_map, moe_ep_rank

    def new(model_config, physical_to_logical_map, moe_ep_rank=None):
        return model_config, physical_to_logical_map, moe_ep_rank

    known = dict(server_args="s", model_config="m", physical_to_logical_map="p", moe_ep_rank=3)
    assert call(old, "eng", **known) == ("s", "m", "p", 3)
    assert call(new, "eng", **known) == ("m", "p", 3)
    with pytest.raises(InputError, match="eng: .*takes 'logical_count', which eplbsim does not"):
        call(lambda logical_count: None, "eng", **known)
