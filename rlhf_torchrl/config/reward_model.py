"""The ``reward-model`` command: train a reward model as ``reward_model.yaml`` says."""

from __future__ import annotations

import json
import logging
import os

import torch
from omegaconf import DictConfig, OmegaConf

from rlhf_torchrl.config.reward_model_schema import validate_reward_model
from rlhf_torchrl.rewards.reward_model import RewardModel

log = logging.getLogger(__name__)


def train_reward_model(cfg: DictConfig) -> dict:
    """Train a reward model as ``cfg`` (``reward_model.yaml``) says; returns the report (also
    ``<output_dir>/report.json``; the model in ``<output_dir>/model``).

    Args:
        cfg: the composed reward-model config (``reward_model.yaml``).
    """
    from rlhf_torchrl.rewards.training import (
        init_reward_head,
        load_preference_pairs,
        preference_metrics,
        reward_offset,
    )
    from rlhf_torchrl.rewards.training import (
        train_reward_model as fit_reward_model,
    )

    validate_reward_model(cfg)
    t, d, m = cfg.train, cfg.data, cfg.model
    torch.manual_seed(cfg.seed)
    train_pairs, eval_pairs = load_preference_pairs(
        d.source, split=d.split, prompt_column=d.prompt_column, chosen_column=d.chosen_column,
        rejected_column=d.rejected_column, eval_fraction=d.eval_fraction, limit=d.limit, seed=cfg.seed)
    log.info("%d training pairs, %d held-out pairs from %s", len(train_pairs), len(eval_pairs), d.source)
    reward_model = RewardModel.from_pretrained(m.name, dtype=m.dtype, batch_size=t.batch_size,
                                               max_length=m.max_length)
    init_reward_head(reward_model.model)
    reward_model.model.requires_grad_(True)
    before = preference_metrics(reward_model, eval_pairs)
    log.info("Held-out accuracy before training: %.3f", before["eval/accuracy"])
    os.makedirs(cfg.output_dir, exist_ok=True)
    with open(os.path.join(cfg.output_dir, "metrics.jsonl"), "w") as f:
        def write(row):
            f.write(json.dumps(row) + "\n")
            f.flush()
            log.info("epoch %d: train loss %.4f, accuracy %.3f | held-out loss %.4f, accuracy %.3f",
                     row["epoch"], row["train/loss"], row["train/accuracy"], row["eval/loss"],
                     row["eval/accuracy"])

        history = fit_reward_model(
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
