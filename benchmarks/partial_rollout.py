"""Partial rollouts against whole responses of widely varying lengths: s/iteration, tokens/s.

``rlhf-torchrl bench partial_rollout`` as a script; the code is in the package,
``rlhf_torchrl/benchmarks/partial_rollout.py``.
"""

import sys

from rlhf_torchrl.cli import main

if __name__ == "__main__":
    main(["bench", "partial_rollout", *sys.argv[1:]])
