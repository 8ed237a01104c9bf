"""What the recipes share on the command line: user errors printed as one line, no traceback."""

from __future__ import annotations

import os
import sys

from rlhf_torchrl.guards import DivergenceError
from rlhf_torchrl.rewards import RewardError
from rlhf_torchrl.sampling import OffPolicyError

#: errors that explain themselves: bad settings or data, and the guards that stop a run
USER_ERRORS = (ValueError, FileNotFoundError, ImportError, RewardError, DivergenceError,
               OffPolicyError)


def run(fn, cfg):
    """``fn(cfg)``; a :data:`USER_ERRORS` error is a message about the input or the run, not
    about this code: printed as ``Error: ...``, exit status 1 (``RLHF_TORCHRL_TRACEBACK=1``
    re-raises it with its traceback)."""
    try:
        return fn(cfg)
    except USER_ERRORS as error:
        if os.environ.get("RLHF_TORCHRL_TRACEBACK"):
            raise
        print(f"Error: {error}", file=sys.stderr, flush=True)
        sys.exit(1)
