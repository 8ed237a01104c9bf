"""The table of estimators.sh's runs (GAE, GRPO, RLOO, REINFORCE++).

``rlhf-torchrl bench estimators_table`` as a script; the code is in the package,
``rlhf_torchrl/benchmarks/estimators_table.py``.
"""

import sys

from rlhf_torchrl.cli import main

if __name__ == "__main__":
    main(["bench", "estimators_table", *sys.argv[1:]])
