"""The recipe under bf16, LoRA, a token budget, torchrun, vLLM, overlap, Ray ....

``rlhf-torchrl bench scaling`` as a script; the code is in the package,
``rlhf_torchrl/benchmarks/scaling.py``.
"""

import sys

from rlhf_torchrl.cli import main

if __name__ == "__main__":
    main(["bench", "scaling", *sys.argv[1:]])
