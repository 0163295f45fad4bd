"""The one exception type for bad user input.

Every check on something a user gave (a trace, a load matrix, a topology, a CLI option) raises
:class:`InputError` with a message that names the problem; the CLI prints that message on one
line and exits with status 2. Input that is used with a part left out (the torn last line of a
log whose writer was stopped) gives an :class:`InputWarning` instead, which the CLI prints as one
line on stderr.
"""


# Exit statuses every command shares (`eplbsim review` adds its verdicts': 0, 1 and 3).
EXIT_INPUT = 2  # a usage or input error (`InputError`), or more memory than the machine has
EXIT_INTERNAL = 4  # an internal error: a bug in eplbsim, to report
EXIT_INTERRUPTED = 130  # stopped by the user (Ctrl-C)


class InputError(ValueError):
    """Input that eplbsim cannot use; the message says what is wrong and where."""


class InputWarning(UserWarning):
    """Input that eplbsim uses with a part left out; the message says which part and where."""
