"""The ``evaluate`` command: a saved policy on the PPO config's held-out prompts."""

from __future__ import annotations

import json
import os

import torch
from omegaconf import DictConfig

from rlhf_torchrl.config import validation
from rlhf_torchrl.config.checks import check_output_dir, check_remote_rewards
from rlhf_torchrl.config.components import (
    make_device,
    make_reward_functions,
    make_reward_probe,
    make_scorer,
    make_tokenizer,
    stop_token_ids,
)
from rlhf_torchrl.config.inputs import hold_out, make_prompts, new_evaluator
from rlhf_torchrl.config.model_checks import check_models, check_sequence_length
from rlhf_torchrl.modules import load_causal_lm


def evaluate_policy(cfg: DictConfig) -> dict:
    """``eval/...`` metrics of ``model.policy`` on the held-out prompts of the PPO config (the
    last ``eval.num_prompts``), against ``model.reference``'s responses when it is set; also
    ``<output_dir>/eval.json`` with every response.

    Args:
        cfg: the composed PPO config.
    """
    from rlhf_torchrl.trainers.evaluation import format_metrics, rollout_samples

    validation.validate(cfg)
    check_output_dir(cfg)
    check_models(cfg)
    check_remote_rewards(cfg)
    reward_functions = make_reward_functions(cfg)
    device = make_device(cfg)
    torch.manual_seed(cfg.seed)
    tokenizer = make_tokenizer(cfg)
    prompts = make_prompts(cfg, tokenizer)
    _, held_out = hold_out(prompts, cfg.eval.num_prompts)
    check_sequence_length(cfg, list(held_out), tokenizer)
    stop_ids = stop_token_ids(cfg, tokenizer)
    scorer = make_scorer(cfg, reward_functions, device, stop_text=tokenizer.decode(stop_ids[:1]),
                         tokenizer=tokenizer)
    scorer.check(make_reward_probe(cfg, prompts, tokenizer, stop_ids))
    m = cfg.model
    evaluator = new_evaluator(cfg, held_out, tokenizer, scorer, stop_ids, device)
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
