"""The figures two or more benchmark --out files share, side by side with ratios.

``rlhf-torchrl bench compare`` as a script; the code is in the package,
``rlhf_torchrl/benchmarks/compare.py``.
"""

import sys

from rlhf_torchrl.cli import main

if __name__ == "__main__":
    main(["bench", "compare", *sys.argv[1:]])
