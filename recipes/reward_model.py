"""Train a reward model on preference pairs (Bradley-Terry), ready for PPO.

    python recipes/reward_model.py                              # offline: MiniLM on review sentences
    python recipes/reward_model.py model.name=HuggingFaceTB/SmolLM2-135M data.source=Anthropic/hh-rlhf
    python recipes/ppo.py reward.model=<output_dir>/model       # then PPO against it

The same as ``rlhf-torchrl reward-model ...``. Writes ``<output_dir>/model`` (a sequence classifier
with its tokenizer; ``config.reward_offset`` makes the training responses average zero),
``metrics.jsonl`` (one row per epoch) and ``report.json`` (held-out accuracy before and after).
"""

import sys

import hydra
from omegaconf import DictConfig

from rlhf_torchrl.cli import check_overrides, run, with_run_dir
from rlhf_torchrl.config.reward_model import train_reward_model as train


@hydra.main(config_path=None, config_name="rlhf_reward_model", version_base=None)
def main(cfg: DictConfig) -> None:
    run(train, cfg)


if __name__ == "__main__":
    check_overrides(sys.argv[1:], "rlhf_reward_model", "reward-model")  # a bad key: one line
    sys.argv[1:] = with_run_dir(sys.argv[1:])  # Hydra's .hydra/ and log: under output_dir
    main()
