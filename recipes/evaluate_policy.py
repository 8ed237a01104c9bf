"""Evaluate a policy on the held-out prompts of the PPO config, or on every prompt of a file, against
a reference.

    python recipes/evaluate_policy.py model.policy=outputs/ppo/<run>/policy model.reference=smollm2-135m-instruct
    python recipes/evaluate_policy.py task=gsm8k model.policy=outputs/ppo/gsm8k/<run>/policy \
        eval.source=test.parquet eval.samples_per_prompt=8 eval.temperature=1.0

The same as ``rlhf-torchrl evaluate ...``. The prompts are those a PPO run with the same data
settings held out (the last ``eval.num_prompts``), or all of ``eval.source``'s; the metrics are
the run's ``eval/...`` ones (score, win rate against ``model.reference``'s responses when it is
set, response length, distinct-n, accuracy for ``eval.accuracy_reward``, pass@k and maj@k with
several samples per prompt). Writes ``eval.json`` (the metrics and every response) and
``report.html`` to ``outputs/evaluate/<date>_<policy>/`` (``output_dir=...``: there).
"""

import sys

import hydra
from omegaconf import DictConfig

from rlhf_torchrl.cli import check_overrides, run, with_run_dir
from rlhf_torchrl.config.evaluate_policy import evaluate_policy as evaluate
from rlhf_torchrl.config.evaluate_policy import evaluation_args


@hydra.main(config_path=None, config_name="rlhf_ppo", version_base=None)
def main(cfg: DictConfig) -> None:
    run(evaluate, cfg)


if __name__ == "__main__":
    check_overrides(sys.argv[1:], "rlhf_ppo", "evaluate")  # a bad key: one line
    # outputs/evaluate/<date>_<policy>/ unless output_dir is given; Hydra's .hydra/ and log there
    sys.argv[1:] = with_run_dir(evaluation_args(sys.argv[1:]))
    main()
