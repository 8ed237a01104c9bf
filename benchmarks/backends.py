"""Tokens/s of the transformers and vLLM backends, and the seconds of a weight push.

``rlhf-torchrl bench backends`` as a script; the code is in the package,
``rlhf_torchrl/benchmarks/backends.py``.
"""

import sys

from rlhf_torchrl.cli import main

if __name__ == "__main__":
    main(["bench", "backends", *sys.argv[1:]])
