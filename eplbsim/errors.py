"""The one exception type for bad user input.

Every check on something a user gave (a trace, a load matrix, a topology, a CLI option) raises
:class:`InputError` with a message that names the problem; the CLI prints that message on one
line and exits with status 2.
"""


class InputError(ValueError):
    """Input that eplbsim cannot use; the message says what is wrong and where."""
