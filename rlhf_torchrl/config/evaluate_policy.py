"""The ``evaluate`` command: a saved policy on the PPO config's held-out prompts, or on every prompt
of a file of its own (``eval.source``), written to an evaluation's folder
(``outputs/evaluate/<date>_<policy>/``: ``eval.json`` and ``report.html``)."""

from __future__ import annotations

import json
import logging
import os
import re

import torch
from omegaconf import DictConfig, OmegaConf

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
from rlhf_torchrl.config.inputs import hold_out, make_eval_prompts, make_prompts, new_evaluator
from rlhf_torchrl.config.model_checks import check_models, check_sequence_length
from rlhf_torchrl.modules import load_causal_lm

log = logging.getLogger(__name__)

#: where an evaluation goes unless ``output_dir`` says otherwise (Hydra resolves it)
EVALUATION_DIR = "outputs/evaluate/${now:%Y-%m-%d_%H-%M-%S}_${evaluation_name:${model.policy}}"


def evaluation_name(policy: str) -> str:
    """A folder name for an evaluation of ``policy``: a training run's saved policy
    (``outputs/ppo/gsm8k/<date>/policy``) is named after its run (``gsm8k_<date>``), anything
    else after its last path component (``Qwen/Qwen2.5-0.5B-Instruct``: ``Qwen2.5-0.5B-Instruct``).

    Args:
        policy: ``model.policy``, a folder or a hub id.

    Example:
        >>> evaluation_name("outputs/ppo/gsm8k/2026-11-24_10-00-00/policy")
        'gsm8k_2026-11-24_10-00-00'
    """
    parts = [p for p in os.path.normpath(str(policy)).split(os.sep) if p not in ("", ".", "..")]
    if len(parts) >= 2 and parts[-1] in ("policy", "policy_merged"):
        name = "_".join(parts[-3:-1])
    else:
        name = parts[-1] if parts else "policy"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name)


OmegaConf.register_new_resolver("evaluation_name", evaluation_name, replace=True)

#: the settings that shape a prompt and end a response: a run's policy evaluated with others
#: answers other prompts than it trained on
PROMPT_SETTINGS = ("data.column", "data.template", "data.chat_template", "data.system_prompt",
                   "data.max_words", "data.max_prompt_length", "generation.stop_token")


def trained_settings(cfg: DictConfig) -> list[str]:
    """The overrides that would evaluate a run's saved policy (``<run>/policy``, the run's
    ``report.json`` beside it) with the prompts it trained on: each of :data:`PROMPT_SETTINGS`
    that the run had otherwise, as ``key=value`` (empty: the same, or not a run's policy).

    Args:
        cfg: the evaluation's composed config.
    """
    report = os.path.join(os.path.dirname(os.path.normpath(str(cfg.model.policy))), "report.json")
    if not os.path.isfile(report):
        return []
    with open(report, encoding="utf-8") as f:
        trained = OmegaConf.create(json.load(f).get("config") or {})
    differ = []
    for key in PROMPT_SETTINGS:
        then, now = OmegaConf.select(trained, key, default="?"), OmegaConf.select(cfg, key)
        if then != "?" and then != now:
            differ.append(f"{key}={_override_value(then)}")
    return differ


def _override_value(value) -> str:
    if value is None:
        return "null"
    text = str(value)
    if re.fullmatch(r"[\w./:@+-]+", text):
        return text
    return json.dumps(text)  # (a template: "Q: {prompt}"; quote the whole override in a shell)


def evaluation_args(args: list[str]) -> list[str]:
    """The ``evaluate`` command's overrides ``args``, with Hydra's run directory (and so
    ``output_dir``) set to the evaluation's folder (:data:`EVALUATION_DIR`) unless ``output_dir=``
    or ``hydra.run.dir=`` is among them.

    Args:
        args: the command line's overrides.
    """
    if any(a.lstrip("+").startswith(("output_dir=", "hydra.run.dir=")) for a in args):
        return list(args)
    return [*args, f"hydra.run.dir='{EVALUATION_DIR}'"]


def evaluate_policy(cfg: DictConfig) -> dict:
    """``eval/...`` metrics of ``model.policy`` on the held-out prompts of the PPO config (the
    last ``eval.num_prompts``) or, with ``eval.source``, on every prompt of that file; against
    ``model.reference``'s responses when it is set. Writes ``<output_dir>/eval.json`` (the
    settings, the metrics and every response with its verdict and answer) and
    ``<output_dir>/report.html``, and prints where.

    Args:
        cfg: the composed PPO config.
    """
    from rlhf_torchrl.record.eval_report import write_eval_report
    from rlhf_torchrl.trainers.evaluation import format_metrics

    e, m = cfg.eval, cfg.model
    if e.source and OmegaConf.is_missing(cfg.data, "source"):
        cfg.data.source = e.source  # no training data is read: the evaluation's file stands in
    validation.validate(cfg)
    check_output_dir(cfg)
    check_models(cfg)
    check_remote_rewards(cfg)
    differ = trained_settings(cfg)
    if differ:  # (the run's task and prompt form are not read from it: the command line wins)
        log.warning("%s was trained on prompts made otherwise; to evaluate it on prompts like "
                    "those, add: %s", m.policy, " ".join(f"'{d}'" for d in differ))
    reward_functions = make_reward_functions(cfg)
    device = make_device(cfg)
    torch.manual_seed(cfg.seed)
    tokenizer = make_tokenizer(cfg)
    if e.source:
        prompts = make_eval_prompts(cfg, tokenizer)
        what = f"the {len(prompts)} prompts of {e.source}"
    else:
        _, prompts = hold_out(make_prompts(cfg, tokenizer), e.num_prompts)
        check_sequence_length(cfg, list(prompts), tokenizer)
        what = f"{len(prompts)} held-out prompts"
    stop_ids = stop_token_ids(cfg, tokenizer)
    scorer = make_scorer(cfg, reward_functions, device, stop_text=tokenizer.decode(stop_ids[:1]),
                         tokenizer=tokenizer)
    scorer.check(make_reward_probe(cfg, prompts, tokenizer, stop_ids))
    evaluator = new_evaluator(cfg, prompts, tokenizer, scorer, stop_ids, device)
    if m.reference:
        reference = load_causal_lm(m.reference, tokenizer, dtype=m.dtype,
                                   attn_implementation=m.attn_implementation).to(device)
        evaluator.set_reference(reference)
        del reference
    policy = load_causal_lm(m.policy, tokenizer, dtype=m.dtype,
                            attn_implementation=m.attn_implementation).to(device)
    metrics, rollout = evaluator(policy)
    path = os.path.join(cfg.output_dir, "eval.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"policy": m.policy, "reference": m.reference,
                   "prompts": e.source or "held out of data.source", "num_prompts": len(prompts),
                   "samples_per_prompt": evaluator.samples_per_prompt,
                   "temperature": evaluator.temperature, "max_new_tokens": evaluator.max_new_tokens,
                   "k": evaluator.ks, "seed": cfg.seed, **metrics,
                   "responses": evaluation_samples(evaluator, rollout)}, f, indent=1)
    report = write_eval_report(cfg.output_dir)
    samples = f", {evaluator.samples_per_prompt} samples each" if evaluator.samples_per_prompt > 1 else ""
    print(f"{m.policy} on {what}{samples}: {format_metrics(metrics)}\n"
          f"Evaluation written to {path} (report: {report})", flush=True)
    return metrics


def evaluation_samples(evaluator, rollout) -> list[dict]:
    """Every response of an evaluation, for ``eval.json``: ``prompt_index`` (the prompt's
    position in the evaluated set; its samples consecutive), the prompt, the question, the
    response and its score; with an accuracy reward also ``correct`` (full marks) and, where
    the reward reads answers, ``answer`` (what maj@k counted; null: none read).

    Args:
        evaluator (rlhf_torchrl.trainers.evaluation.Evaluator): the evaluator that sampled it.
        rollout (tensordict.TensorDictBase): its scored rollout.
    """
    from rlhf_torchrl import keys as K
    from rlhf_torchrl.trainers.evaluation import rollout_samples

    rows = rollout_samples(rollout)
    for row, group in zip(rows, rollout.get(K.GROUP).tolist()):
        row["prompt_index"] = group
    if evaluator.accuracy is not None:
        correct, answers = evaluator.verdicts(rollout)
        for i, row in enumerate(rows):
            row["correct"] = bool(correct[i])
            if answers is not None:
                a = answers[i]
                row["answer"] = a if a is None or isinstance(a, (int, float, str)) else str(a)
    return rows
