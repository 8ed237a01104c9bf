"""Evaluate a policy on the held-out prompts of the PPO config, against a reference.

    python recipes/evaluate_policy.py model.policy=outputs/ppo/<run>/policy model.reference=smollm2-135m-instruct

The prompts are those a PPO run with the same data settings held out (the last
``eval.num_prompts``); the metrics are the run's ``eval/...`` ones (score, win rate against
``model.reference``'s responses when it is set, response length, distinct-n, accuracy for
``eval.accuracy_reward``). Writes ``<output_dir>/eval.json`` with the metrics and every response.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import hydra
import torch
from omegaconf import DictConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import builders  # noqa: E402
import cli  # noqa: E402
import schema  # noqa: E402, F401 - registers the config schema with Hydra

from rlhf_torchrl.evaluation import format_metrics, rollout_samples  # noqa: E402
from rlhf_torchrl.modules import load_causal_lm  # noqa: E402

log = logging.getLogger("evaluate")


def evaluate(cfg: DictConfig) -> dict:
    """``eval/...`` metrics of ``model.policy`` on the held-out prompts (also ``eval.json``)."""
    schema.validate(cfg)
    builders.check_output_dir(cfg)
    builders.check_models(cfg)
    reward_functions = builders.make_reward_functions(cfg)
    device = builders.make_device(cfg)
    torch.manual_seed(cfg.seed)
    tokenizer = builders.make_tokenizer(cfg)
    prompts = builders.make_prompts(cfg, tokenizer)
    held_out = prompts[-cfg.eval.num_prompts:]
    stop_ids = builders.stop_token_ids(cfg, tokenizer)
    scorer = builders.make_scorer(cfg, reward_functions, device)
    scorer.check(builders.make_reward_probe(cfg, prompts, tokenizer, stop_ids))
    m = cfg.model
    evaluator = builders.new_evaluator(cfg, held_out, tokenizer, scorer, stop_ids, device)
    if m.reference:
        reference = load_causal_lm(m.reference, tokenizer, dtype=m.dtype,
                                   attn_implementation=m.attn_implementation).to(device)
        evaluator.set_reference(reference)
        del reference
    policy = load_causal_lm(m.policy, tokenizer, dtype=m.dtype,
                            attn_implementation=m.attn_implementation).to(device)
    metrics, rollout = evaluator(policy)
    with open(os.path.join(cfg.output_dir, "eval.json"), "w") as f:
        json.dump({"policy": m.policy, "reference": m.reference, **metrics,
                   "responses": rollout_samples(rollout)}, f, indent=1)
    print(f"{m.policy} on {len(held_out)} held-out prompts: {format_metrics(metrics)}", flush=True)
    return metrics


@hydra.main(config_path="config", config_name="ppo", version_base=None)
def main(cfg: DictConfig) -> None:
    cli.run(evaluate, cfg)


if __name__ == "__main__":
    main()
