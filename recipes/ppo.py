"""PPO-RLHF with TorchRL: the package's trainer, built from the Hydra config.

    python recipes/ppo.py                                  # offline default (SmolLM2 + VADER)
    python recipes/ppo.py task=arithmetic ppo.batch_size=16
    torchrun --nproc_per_node=2 recipes/ppo.py distributed.strategy=fsdp2   # data parallel

The same as ``rlhf-torchrl ppo ...``. Every setting is in the package's ``config/ppo.yaml``
(``rlhf-torchrl ppo --help``); ``rlhf_torchrl.config.builders`` turns config into components and
hooks. Copy this script to change the run: swap a component or register a hook before ``fit()``.
"""

import sys

import hydra
from omegaconf import DictConfig

from rlhf_torchrl.cli import check_overrides, run, with_run_dir
from rlhf_torchrl.config import builders, resume


def train(cfg: DictConfig) -> dict:
    report = resume.finished_run(cfg)  # output_dir holds this run, finished: its report
    if report is not None:
        return report
    trainer = builders.build_trainer(cfg)  # collector, scorer, actor/reference/critic, loss, hooks
    # e.g. a metric of your own, logged with the others:
    # trainer.register_op("post_steps_log", lambda batch: {"my/rows": batch.shape[0]})
    try:
        return trainer.fit()
    finally:
        trainer.parallel.shutdown()


@hydra.main(config_path=None, config_name="rlhf_ppo", version_base=None)
def main(cfg: DictConfig) -> None:
    run(train, cfg)  # a bad setting or input: one line, exit status 1


if __name__ == "__main__":
    # an unknown task= or key, a wrong type: one line, not Hydra's search path or five lines
    check_overrides(sys.argv[1:])
    sys.argv[1:] = with_run_dir(sys.argv[1:])  # Hydra's .hydra/ and log: under output_dir
    main()
