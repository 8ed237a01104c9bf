"""Evaluate a policy on the held-out prompts of the PPO config, against a reference.

    python recipes/evaluate_policy.py model.policy=outputs/ppo/<run>/policy model.reference=smollm2-135m-instruct

The same as ``rlhf-torchrl evaluate ...``. The prompts are those a PPO run with the same data
settings held out (the last ``eval.num_prompts``); the metrics are the run's ``eval/...`` ones
(score, win rate against ``model.reference``'s responses when it is set, response length,
distinct-n, accuracy for ``eval.accuracy_reward``). Writes ``<output_dir>/eval.json`` with the
metrics and every response.
"""

import sys

import hydra
from omegaconf import DictConfig

from rlhf_torchrl.cli import check_overrides, run, with_run_dir
from rlhf_torchrl.config.evaluate_policy import evaluate_policy as evaluate


@hydra.main(config_path=None, config_name="rlhf_ppo", version_base=None)
def main(cfg: DictConfig) -> None:
    run(evaluate, cfg)


if __name__ == "__main__":
    check_overrides(sys.argv[1:], "rlhf_ppo", "evaluate")  # a bad key: one line
    sys.argv[1:] = with_run_dir(sys.argv[1:])  # Hydra's .hydra/ and log: under output_dir
    main()
