"""Every CUDA path in one table (needs a CUDA GPU).

``rlhf-torchrl bench gpu_suite`` as a script; the code is in the package,
``rlhf_torchrl/benchmarks/gpu_suite.py``.
"""

import sys

from rlhf_torchrl.cli import main

if __name__ == "__main__":
    main(["bench", "gpu_suite", *sys.argv[1:]])
