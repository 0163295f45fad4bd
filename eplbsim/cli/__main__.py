"""`python -m eplbsim.cli` (as torchrun starts the ranks) runs the `eplbsim` command."""

import sys

from . import main

sys.exit(main())
