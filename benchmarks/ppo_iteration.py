"""Seconds per PPO iteration by phase, next to bare model calls (the floor).

``rlhf-torchrl bench ppo_iteration`` as a script; the code is in the package,
``rlhf_torchrl/benchmarks/ppo_iteration.py``.
"""

import sys

from rlhf_torchrl.cli import main

if __name__ == "__main__":
    main(["bench", "ppo_iteration", *sys.argv[1:]])
