"""Start-up time and peak memory of a prompt set by form and size (10k-1M rows).

``rlhf-torchrl bench data_loading`` as a script; the code is in the package,
``rlhf_torchrl/benchmarks/data_loading.py``.
"""

import sys

from rlhf_torchrl.cli import main

if __name__ == "__main__":
    main(["bench", "data_loading", *sys.argv[1:]])
