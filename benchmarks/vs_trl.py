"""Side by side with TRL's PPOTrainer at identical settings (installs TRL in a venv).

``rlhf-torchrl bench vs_trl`` as a script; the code is in the package,
``rlhf_torchrl/benchmarks/vs_trl.py``.
"""

import sys

from rlhf_torchrl.cli import main

if __name__ == "__main__":
    main(["bench", "vs_trl", *sys.argv[1:]])
