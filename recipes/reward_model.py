"""Train a reward model on preference pairs (Bradley-Terry), ready for PPO.

    python recipes/reward_model.py                              # offline: MiniLM on review sentences
    python recipes/reward_model.py model.name=HuggingFaceTB/SmolLM2-135M data.source=Anthropic/hh-rlhf
    python recipes/ppo.py reward.model=<output_dir>/model       # then PPO against it

Writes ``<output_dir>/model`` (a sequence classifier with its tokenizer; ``config.reward_offset``
makes the training responses average zero), ``metrics.jsonl`` (one row per epoch) and
``report.json`` (held-out accuracy before and after).
"""

from __future__ import annotations

import json
import logging
import os
import sys

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cli  # noqa: E402

from rlhf_torchrl.reward_training import (  # noqa: E402
    evaluate_pairs,
    init_reward_head,
    load_preference_pairs,
    reward_offset,
    train_reward_model,
)
from rlhf_torchrl.rewards import RewardModel  # noqa: E402

log = logging.getLogger("reward_model")


def train(cfg: DictConfig) -> dict:
    """Train as configured; returns the report (also ``report.json``)."""
    t, d, m = cfg.train, cfg.data, cfg.model
    for key in ("epochs", "batch_size"):
        if int(t[key]) < 1:
            raise ValueError(f"train.{key}={t[key]} is out of range: it must be >= 1.")
    if not 0 < d.eval_fraction < 1:
        raise ValueError(f"data.eval_fraction={d.eval_fraction} is out of range: it must be in (0, 1).")
    if t.lr <= 0:
        raise ValueError(f"train.lr={t.lr} is out of range: it must be > 0.")
    torch.manual_seed(cfg.seed)
    train_pairs, eval_pairs = load_preference_pairs(
        d.source, split=d.split, prompt_column=d.prompt_column, chosen_column=d.chosen_column,
        rejected_column=d.rejected_column, eval_fraction=d.eval_fraction, limit=d.limit, seed=cfg.seed)
    log.info("%d training pairs, %d held-out pairs from %s", len(train_pairs), len(eval_pairs), d.source)
    reward_model = RewardModel.from_pretrained(m.name, dtype=m.dtype, batch_size=t.batch_size,
                                               max_length=m.max_length)
    init_reward_head(reward_model.model)
    reward_model.model.requires_grad_(True)
    before = evaluate_pairs(reward_model, eval_pairs)
    log.info("Held-out accuracy before training: %.3f", before["eval/accuracy"])
    os.makedirs(cfg.output_dir, exist_ok=True)
    with open(os.path.join(cfg.output_dir, "metrics.jsonl"), "w") as f:
        def write(row):
            f.write(json.dumps(row) + "\n")
            f.flush()
            log.info("epoch %d: train loss %.4f, accuracy %.3f | held-out loss %.4f, accuracy %.3f",
                     row["epoch"], row["train/loss"], row["train/accuracy"], row["eval/loss"],
                     row["eval/accuracy"])

        history = train_reward_model(
            reward_model, train_pairs, eval_pairs, epochs=t.epochs, batch_size=t.batch_size,
            lr=t.lr, weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm, seed=cfg.seed,
            log=write)
    offset = reward_offset(reward_model, train_pairs) if t.normalize else 0.0
    model = reward_model.model
    model.config.reward_offset = offset
    path = os.path.join(cfg.output_dir, "model")
    model.save_pretrained(path)
    reward_model.tokenizer.save_pretrained(path)
    report = {"eval/accuracy": history[-1]["eval/accuracy"],
              "eval/accuracy_before": before["eval/accuracy"],
              "eval/loss": history[-1]["eval/loss"], "reward_offset": offset,
              "train_pairs": len(train_pairs), "eval_pairs": len(eval_pairs), "model_path": path,
              "history": history}
    with open(os.path.join(cfg.output_dir, "report.json"), "w") as f:
        json.dump({"config": OmegaConf.to_container(cfg, resolve=True), **report}, f, indent=1)
    print(f"\nReward model: held-out accuracy {before['eval/accuracy']:.3f} -> "
          f"{report['eval/accuracy']:.3f} on {len(eval_pairs)} pairs; offset {offset:+.3f}; "
          f"saved to {path}", flush=True)
    return report


@hydra.main(config_path="config", config_name="reward_model", version_base=None)
def main(cfg: DictConfig) -> None:
    cli.run(train, cfg)


if __name__ == "__main__":
    main()
