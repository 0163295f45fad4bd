"""The one exception type for bad user input.

Every check on something a user gave (a trace, a load matrix, a topology, a CLI option) raises
:class:`InputError` with a message that names the problem; the CLI prints that message on one
line and exits with status 2. Input that is used with a part left out (the torn last line of a
log whose writer was stopped) gives an :class:`InputWarning` instead, which the CLI prints as one
line on stderr. What a run warns of (a model priced that is not the trace's, warm-up steps in
it) is a :class:`RunWarning`, given at the caller's own line (`warn_caller`).
"""

import sys
import warnings


# Exit statuses every command shares (`eplbsim review` adds its verdicts': 0, 1 and 3).
EXIT_INPUT = 2  # a usage or input error (`InputError`), or more memory than the machine has
EXIT_INTERNAL = 4  # an internal error: a bug in eplbsim, to report
EXIT_INTERRUPTED = 130  # stopped by the user (Ctrl-C)


class InputError(ValueError):
    """Input that eplbsim cannot use; the message says what is wrong and where."""


class InputWarning(UserWarning):
    """Input that eplbsim uses with a part left out; the message says which part and where."""


class RunWarning(UserWarning):
    """What a run warns of: a model priced that is not the trace's, warm-up or outlier steps in
    the trace (`replay.results.run_warnings`). A Python caller gets it at its own line and on
    the results (`Results.warnings`); the command line prints it in the run's header instead."""


def warn_caller(message: str, category: type[Warning] = RunWarning) -> None:
    """`warnings.warn(message, category)` at the line that called into eplbsim: the first frame
    outside the package, so a script or notebook sees its own line, whichever entry point of
    the package it called."""
    frame, level = sys._getframe(1), 2  # level 2: the caller of this function
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] \
            == "eplbsim":
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
