"""The documented size caps: values above them are refused up front, with the cap in the
message, instead of running until memory or patience runs out. They sit far above any MoE
model in use (hundreds of experts, top-8, tens of layers, thousands of GPUs); memory beyond
these caps is checked separately (`files.check_memory`).
"""

import math

from .errors import InputError

MAX_EXPERTS = 1 << 16  # logical experts E of a layer
MAX_SLOTS = 1 << 18  # physical slots P of a layer
MAX_LAYERS = 1 << 12  # MoE layers L of a trace, and layers of a model (dense ones included)
MAX_TOP_K = 1 << 10  # experts per token K
MAX_GPUS = 1 << 16  # GPUs = EP ranks G
MAX_SEED = 2**32 - 1  # seeds are 32-bit
MAX_HIDDEN = 1 << 12  # hidden size of the toy MoE layer
MAX_CELLS = 10_000  # cells of a sweep unless --max-cells raises it
MAX_LOAD = 2**53  # per-layer sums of loads: the largest exact integer of float64
MAX_BATCH = 1 << 24  # rows of one step a workload makes (a CUDA-graph size, a token budget)
MAX_EXPERT_BYTES = 1 << 40  # one expert's weights: above the memory of any GPU that holds one
MAX_COUNT = 1 << 62  # any other count a setting holds (steps, tokens, a window, requests)


def shown(value: object) -> str:
    """`value` as a message quotes it: `repr`, but an integer of more than 24 digits as "a
    310-digit number" (a pasted run of digits is not worth echoing, and Python refuses to
    print one of more than 4300)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**24:
        try:
            digits = str(len(str(abs(value))))
        except ValueError:  # beyond Python's 4300 digits
            digits = f"{math.log10(abs(value)):.0f}"
        return f"a {digits}-digit number"
    return repr(value)


def check_at_most(value: int, cap: int, what: str) -> int:
    """`value` if it is at most `cap`; InputError naming `what` and the cap otherwise."""
    if value > cap:
        raise InputError(f"{what} is {value}, above the cap of {cap} (eplbsim.base.limits)")
    return value
