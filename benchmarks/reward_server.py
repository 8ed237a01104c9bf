"""A served reward model under N concurrent clients: p50/p99 latency and throughput.

``rlhf-torchrl bench reward_server`` as a script; the code is in the package,
``rlhf_torchrl/benchmarks/reward_server.py``.
"""

import sys

from rlhf_torchrl.cli import main

if __name__ == "__main__":
    main(["bench", "reward_server", *sys.argv[1:]])
