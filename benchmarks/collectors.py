"""Response tokens/s of the TorchRL collector against a raw generate.

``rlhf-torchrl bench collectors`` as a script; the code is in the package,
``rlhf_torchrl/benchmarks/collectors.py``.
"""

import sys

from rlhf_torchrl.cli import main

if __name__ == "__main__":
    main(["bench", "collectors", *sys.argv[1:]])
