"""Step kernels equal the reference policies bit for bit (CPU numba, plain torch, and CUDA
when present), on random traces with padding, duplicates and odd sizes.

Dimensions: `T` tokens, `L` layers, `K` top-k, `E` experts, `P` slots, `G` GPUs.
"""

import dataclasses

import numpy as np

import pytest
import torch
from hypothesis import given, settings, strategies as st

from eplbsim.dispatch import POLICIES
from eplbsim.dispatch.kernels import cpu, dispatch_step, reference_step, step_kernel, torch_step
from eplbsim.dispatch.policies import DispatchContext, layer_offsets
from eplbsim.dispatch.streams import Stream, stream_key
from eplbsim.placement import Placement, full_view, sglang_0_5_14_view
from eplbsim.placement.topology import Topology

KERNEL_POLICIES = sorted(name for name, entry in POLICIES.items() if entry.kernels)


def test_every_registered_kernel_has_the_step_signature_or_needs_a_missing_module():
    """A kernel name that does not resolve is skipped only when its module cannot import."""
    import importlib
    for name, entry in POLICIES.items():
        for device, kernels in entry.kernels.items():
            for kernel in kernels:
                module, _, function = kernel.rpartition(".")
                try:
                    loaded = importlib.import_module(f"eplbsim.dispatch.kernels.{module}")
                except ImportError:
                    continue  # e.g. triton absent: dispatch_step falls back
                assert callable(getattr(loaded, function)), (name, device, kernel)
    assert step_kernel(POLICIES["row"], "cpu") is cpu.row_step


@st.composite
def steps(draw):
    G = draw(st.sampled_from([1, 2, 4]))
    E = draw(st.integers(1, 13))
    per_gpu = draw(st.integers(-(-E // G), -(-E // G) + 3))
    L, K = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    T = draw(st.integers(0, 50) | st.integers(150, 300))  # several chunks and spans of tokens
    seed = draw(st.integers(0, 2**20))
    gen = torch.Generator().manual_seed(seed)
    P = G * per_gpu
    p2l = torch.stack([torch.cat([torch.arange(E), torch.randint(0, E, (P - E,), generator=gen)])
                       [torch.randperm(P, generator=gen)] for _ in range(L)])
    placement = Placement(p2l, E, Topology(G, 2 if G % 2 == 0 else 1))
    ids = torch.randint(0, E, (T, L, K), generator=gen)  # duplicates within a row allowed
    ids = torch.where(torch.rand(T, L, K, generator=gen) < 0.2, -1, ids)
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    return placement, ids.to(dtype), draw(st.integers(0, G - 1)), draw(st.integers(0, 9))


def ctx(rank, step, seed=3, streamed=False):
    """Rank `rank`'s context at `step`: drawing from a fresh generator (an engine's way), or
    from its counter-based stream, shifted by `step % 3` layers (the replay's way)."""
    if streamed:
        return DispatchContext(step=step, rank=rank, seed=seed,
                               stream=Stream(stream_key(seed, rank), step, step % 3))
    return DispatchContext(step=step, rank=rank, seed=seed,
                           generator=torch.Generator().manual_seed(11 + rank))


@pytest.mark.parametrize("name", KERNEL_POLICIES)
@pytest.mark.parametrize("view_fn", [full_view, sglang_0_5_14_view])
@pytest.mark.parametrize("streamed", [False, True])
@settings(max_examples=30, deadline=None)
@given(case=steps())
def test_step_kernels_equal_the_reference(name, view_fn, streamed, case):
    placement, ids, rank, step = case
    view = view_fn(placement, rank)
    policy = POLICIES[name]
    want = reference_step(policy, ids, view, ctx(rank, step, streamed=streamed))
    kernels = [step_kernel(policy, "cpu"), getattr(torch_step, f"{name}_step", None)]
    for kernel in filter(None, kernels):
        got = kernel(ids, view, ctx(rank, step, streamed=streamed))
        assert got.dtype == torch.int64 and torch.equal(got, want), kernel


@pytest.mark.parametrize("blocks", [1, 2, 3, 7])
def test_cpu_ordinal_blocks_scan_across_block_boundaries(blocks):
    gen = torch.Generator().manual_seed(blocks)
    placement = Placement(torch.tensor([[0, 1, 2, 0, 0, 1, 3, 2]] * 2), 4, Topology(2))
    view = full_view(placement)
    ids = torch.randint(-1, 4, (37, 2, 3), generator=gen).to(torch.int32)
    c = ctx(0, 5)
    want = reference_step(POLICIES["ordinal"], ids, view, c)
    out = np.full(ids.shape, 12345, np.int64)  # poisoned: every entry must be written
    cpu._ordinal(ids.numpy(), view.log2phy.numpy(), view.logcnt.numpy(),
                 layer_offsets(c, 2).numpy(), out, blocks)
    assert torch.equal(torch.from_numpy(out), want)


def test_random_kernels_consume_the_generator_like_the_reference():
    placement = Placement(torch.tensor([[0, 1, 0, 1]] * 3), 2, Topology(2))
    ids = torch.randint(0, 2, (9, 3, 2), generator=torch.Generator().manual_seed(0))
    refs, fast = ctx(0, 0), ctx(0, 0)
    for _ in range(2):  # two steps in a row stay in lockstep
        want = reference_step(POLICIES["random"], ids, full_view(placement), refs)
        got = dispatch_step(POLICIES["random"], ids, full_view(placement), fast)
        assert torch.equal(got, want)
    assert torch.equal(refs.generator.get_state(), fast.generator.get_state())


def test_dispatch_step_falls_back_to_the_reference_for_other_policies():
    placement = Placement(torch.tensor([[0, 1, 0, 1]]), 2, Topology(2))
    ids = torch.tensor([[[0, 1]], [[1, 0]], [[0, -1]]])
    for name in ("flat", "hash"):  # as a user's own entry, without the registry's kernels
        mine = dataclasses.replace(POLICIES[name], kernels={})
        assert step_kernel(mine, "cpu") is None
        got = dispatch_step(mine, ids, full_view(placement), ctx(0, 0))
        assert torch.equal(got, reference_step(mine, ids, full_view(placement), ctx(0, 0)))
        assert torch.equal(got, dispatch_step(POLICIES[name], ids, full_view(placement),
                                              ctx(0, 0)))


@pytest.mark.parametrize("name", KERNEL_POLICIES)
def test_dispatch_step_on_device_equals_cpu_reference(name, device):
    gen = torch.Generator().manual_seed(1)
    p2l = torch.cat([torch.arange(10), torch.randint(0, 10, (6,), generator=gen)])
    placement = Placement(torch.stack([p2l, p2l.flip(0)]), 10, Topology(4, 2))
    ids = torch.where(torch.rand(300, 2, 4, generator=gen) < 0.1, -1,
                      torch.randint(0, 10, (300, 2, 4), generator=gen)).to(torch.int32)
    view = full_view(placement, 2)
    dev_ctx = DispatchContext(step=4, rank=2, seed=3,
                              generator=torch.Generator(device=device).manual_seed(11))
    got = dispatch_step(POLICIES[name], ids.to(device), view.to(device), dev_ctx)
    dev_ref = DispatchContext(step=4, rank=2, seed=3,
                              generator=torch.Generator(device=device).manual_seed(11))
    want = reference_step(POLICIES[name], ids.to(device), view.to(device), dev_ref)
    assert got.device.type == torch.device(device).type
    assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("replicas", [3, 40])  # stepped `t % n` (R <= L K), and the division
def test_cpu_row_steps_its_remainders_or_divides_as_the_reference(replicas):
    E, G = 2, 2
    P = E + replicas - 1 + (E + replicas - 1) % G  # expert 0 holds `replicas` slots, or one more
    p2l = torch.tensor([[0] * (P - 1) + [1]])
    placement = Placement(p2l, E, Topology(G))
    assert int(placement.logcnt.max()) >= replicas
    ids = torch.randint(-1, E, (1001, 1, 2), generator=torch.Generator().manual_seed(replicas))
    view = full_view(placement)
    ctx = DispatchContext()
    want = reference_step(POLICIES["row"], ids, view, ctx)
    assert torch.equal(cpu.row_step(ids, view, ctx), want)


@pytest.mark.parametrize("name", [n for n in KERNEL_POLICIES if "cpu" in POLICIES[n].kernels])
def test_cpu_kernels_write_into_the_callers_scratch(name):
    placement = Placement(torch.tensor([[0, 1, 0, 2, 3, 1, 2, 3]] * 2), 4, Topology(4, 2))
    view = full_view(placement)
    ids = torch.randint(-1, 4, (33, 2, 2), generator=torch.Generator().manual_seed(4))
    c = DispatchContext(step=2, rank=1, seed=3, stream=Stream(stream_key(3, 1), 2))
    want = dispatch_step(POLICIES[name], ids, view, c)
    out = np.full(ids.shape, 12345, np.int64)  # poisoned: every entry must be written
    got = dispatch_step(POLICIES[name], ids, view, c, out=out)
    assert torch.equal(got, want) and np.array_equal(out, want.numpy())
    assert got.data_ptr() == out.ctypes.data, "a view of the scratch, not a copy"
    with pytest.raises(ValueError, match="out must be int64"):
        dispatch_step(POLICIES[name], ids, view, c, out=np.empty((1, 2, 2), np.int64))


def test_the_compiled_choice_check_names_the_first_bad_pair_as_the_torch_rule_does():
    """`kernels.cpu.first_bad_choice` against the rule written in torch: the first pair (in
    token, layer, top-k order) that is out of range, not a slot of its expert (unless the
    policy reroutes), or not -1 at padding."""
    from eplbsim.dispatch.kernels.cpu import first_bad_choice
    gen = torch.Generator().manual_seed(9)
    L, E, P, T, K = 3, 6, 9, 40, 4
    phy2log = torch.stack([torch.cat([torch.randperm(E, generator=gen),
                                      torch.randint(0, E, (P - E,), generator=gen)])
                           for _ in range(L)])
    for trial in range(40):
        ids = torch.randint(-1, E, (T, L, K), generator=gen)
        phys = torch.randint(-2, P + 2, (T, L, K), generator=gen)
        if trial % 4 == 0:  # every pair right: a slot of its expert, -1 at padding
            slots = [torch.nonzero(phy2log[layer] == e)[0, 0] for layer in range(L)
                     for e in range(E)]
            table = torch.stack(slots).view(L, E)
            phys = torch.where(ids >= 0, table.gather(1, ids.clamp(min=0).permute(1, 0, 2)
                                                      .reshape(L, -1)).view(L, T, K)
                               .permute(1, 0, 2), -1)
        for reroutes in (False, True):
            held = phy2log.reshape(-1)[(torch.arange(L).view(1, L, 1) * P
                                        + phys.clamp(0, P - 1)).reshape(-1)].view(T, L, K)
            bad = torch.where(ids >= 0, (phys < 0) | (phys >= P) | ((held != ids) & (not reroutes)),
                              phys != -1)
            want = tuple(bad.nonzero()[0].tolist()) if bad.any() else None
            assert first_bad_choice(phys, ids, phy2log, reroutes) == want
