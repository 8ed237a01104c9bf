"""Evaluation on held-out prompts: score, task accuracy, pass@k and maj@k, win rate against the
reference, length, distinct-n.

:class:`Evaluator` samples ``samples_per_prompt`` responses per held-out prompt from a model (one
by default, at a low temperature; the same TorchRL collector as training, its own random
streams), scores them with the run's :class:`~rlhf_torchrl.rewards.scoring.Scorer`, and compares
them with the reference policy's responses to the same prompts (sampled once and kept: the
reference is frozen).
"""

from __future__ import annotations

import torch

from rlhf_torchrl import keys as K
from rlhf_torchrl.collectors import RolloutCollector, make_generation_env, make_generation_policy
from rlhf_torchrl.functional.at_k import majority_at_k, mean_interval, pass_at_k

_EVAL_BATCH = 2**40  # the batch index of the evaluation's row streams


def distinct_n(responses: list[str], n: int) -> float:
    """Distinct n-grams over all n-grams of the responses (whitespace tokens): 1.0 when no
    n-gram repeats, near 0 when every response says the same thing (Li et al. 2016).

    Args:
        responses: the response texts.
        n: the n-gram length, in whitespace tokens.
    """
    grams = [tuple(words[i : i + n]) for r in responses
             for words in [r.split()] for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def default_ks(samples_per_prompt: int) -> list[int]:
    """The k of pass@k and maj@k when none are given: 1, 2, 4, ... below ``samples_per_prompt``,
    and ``samples_per_prompt`` itself; none with one sample (pass@1 is then ``eval/accuracy``).

    Args:
        samples_per_prompt: the responses sampled per prompt, ``n``.

    Example:
        >>> default_ks(6)
        [1, 2, 4, 6]
    """
    if samples_per_prompt <= 1:
        return []
    return [2**i for i in range(samples_per_prompt.bit_length()) if 2**i < samples_per_prompt] + [
        samples_per_prompt]


def win_rate(scores: torch.Tensor, reference_scores: torch.Tensor) -> float:
    """Share of prompts where the policy's response scores higher than the reference's; a tie
    counts one half.

    Args:
        scores: (N,) the policy's scores, one per prompt.
        reference_scores: (N,) the reference's, for the same prompts.
    """
    wins = (scores > reference_scores).float() + 0.5 * (scores == reference_scores).float()
    return float(wins.mean())


class Evaluator:
    """Responses to ``prompts`` at ``temperature``, scored and compared with the reference's.

    With ``samples_per_prompt = n > 1`` each prompt is answered ``n`` times (its rows consecutive,
    the same group); every ``eval/`` metric then averages all the responses, and with
    ``accuracy`` each ``k`` of ``ks`` adds ``eval/pass@k`` (Chen et al.'s unbiased estimator) and,
    where the accuracy reward can read a response's answer (its ``extract_answer`` attribute,
    as :func:`~rlhf_torchrl.rewards.functions.gsm8k_correct` has), ``eval/maj@k`` (the majority
    answer's correctness, exact over all ``k``-subsets): each the mean over prompts, with
    ``eval/pass@k_ci95`` and ``eval/maj@k_ci95``, the half-width of a normal 95% interval over
    prompts (:func:`~rlhf_torchrl.functional.pass_at_k`, :func:`~rlhf_torchrl.functional.majority_at_k`,
    :func:`~rlhf_torchrl.functional.mean_interval`).

    Args:
        prompts (Sequence): the held-out prompts, as
            :func:`~rlhf_torchrl.collectors.make_generation_env` takes them.
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer.
        scorer (rlhf_torchrl.rewards.scoring.Scorer): scores the responses.
        max_new_tokens: the response budget, in tokens.
        temperature: the sampling temperature.
        stop_token_ids (Sequence[int]): the ids that end a response.
        seed: the sampling streams' seed (the same responses for the same weights).
        judge: the ``("scores", name)`` entry the win rate compares (the reward model's, where
            there is one); None: the total score.
        accuracy: the entry of a verifiable reward (1 for a correct answer) reported as
            ``eval/accuracy`` (None: none).
        device (torch.device | str | None): where prompts are tokenised and rollouts placed
            (None: the model's device).
        episode: the keyword arguments of :class:`~rlhf_torchrl.collectors.MultiTurnCollector`
            (``tools``, ``max_turns``, ...) for episodes with tools, as in training; then
            ``eval/turns_per_episode`` and ``eval/tool_calls_per_episode`` are reported too.
            None: single responses.
        samples_per_prompt: ``n``, the responses sampled per prompt.
        ks: the ``k`` of pass@k and maj@k, each in ``[1, n]`` (None: :func:`default_ks`).
        batch_size: the responses sampled at once, whole groups of ``n`` (at least one group);
            None: all of them in one batch.
    """

    def __init__(self, prompts, tokenizer, scorer, *, max_new_tokens: int, temperature: float,
                 stop_token_ids, seed: int = 0, judge: str | None = None,
                 accuracy: str | None = None, device=None, episode: dict | None = None,
                 samples_per_prompt: int = 1, ks=None, batch_size: int | None = None):
        self.prompts, self.tokenizer, self.scorer = list(prompts), tokenizer, scorer
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.stop_token_ids, self.seed, self.device = list(stop_token_ids), seed, device
        self.judge, self.accuracy, self.episode = judge, accuracy, episode
        self.samples_per_prompt, self.batch_size = samples_per_prompt, batch_size
        self.ks = default_ks(samples_per_prompt) if ks is None else [int(k) for k in ks]
        if samples_per_prompt < 1 or any(not 1 <= k <= samples_per_prompt for k in self.ks):
            raise ValueError(f"Evaluator: ks={self.ks} must each be in [1, samples_per_prompt="
                             f"{samples_per_prompt}].")
        self._reference = None

    @torch.no_grad()
    def sample(self, model):
        """``samples_per_prompt`` scored responses per prompt from ``model`` (a causal LM), in
        prompt order (a prompt's rows consecutive, ``"group"`` its index).

        Args:
            model (torch.nn.Module): a causal LM.
        """
        from rlhf_torchrl.data.rollout import concat_rollouts

        n, total = self.samples_per_prompt, len(self.prompts)
        per_batch = total if self.batch_size is None else max(1, self.batch_size // n)  # prompts
        policy = make_generation_policy(model, self.tokenizer, max_new_tokens=self.max_new_tokens,
                                        temperature=self.temperature,
                                        stop_token_ids=self.stop_token_ids, device=self.device)
        was_training = model.training
        model.eval()
        rollouts = []
        try:
            for index, start in enumerate(range(0, total, per_batch)):
                rollouts.append(self._sample_batch(policy, self.prompts[start:start + per_batch],
                                                   index))
        finally:
            model.train(was_training)
        rollout = rollouts[0] if len(rollouts) == 1 else concat_rollouts(
            rollouts, self.tokenizer.pad_token_id)
        rollout.set(K.GROUP, torch.arange(total, device=rollout.device).repeat_interleave(n))
        return rollout

    def _sample_batch(self, policy, prompts: list, index: int):
        """The scored responses to ``prompts``, ``samples_per_prompt`` each: the evaluation's
        batch ``index``."""
        rows = len(prompts) * self.samples_per_prompt
        env = make_generation_env(prompts, self.tokenizer, batch_size=rows, shuffle=False,
                                  samples_per_prompt=self.samples_per_prompt)
        # streams of their own: the training batches are indexed from 0, evaluation far above
        collector = RolloutCollector(env, policy, tokenizer=self.tokenizer, batch_size=rows,
                                     stop_token_ids=self.stop_token_ids, seed=self.seed,
                                     device=self.device, start_batch=_EVAL_BATCH + index,
                                     samples_per_prompt=self.samples_per_prompt)
        if self.episode:
            from rlhf_torchrl.collectors import MultiTurnCollector

            collector = MultiTurnCollector(collector, policy, tokenizer=self.tokenizer,
                                           max_new_tokens=self.max_new_tokens, **self.episode)
        try:
            rollout = next(iter(collector))
        finally:
            collector.shutdown()
        self.scorer(rollout)
        return rollout

    def _judged(self, rollout) -> torch.Tensor:
        if self.judge is not None:
            return rollout.get(("scores", self.judge))
        return rollout.get(K.SCORE)

    def set_reference(self, model) -> None:
        """Sample (once) the reference policy's responses the win rate compares with.

        Args:
            model (torch.nn.Module): the reference causal LM.
        """
        self._reference = self.sample(model)

    def __call__(self, model) -> tuple[dict[str, float], object]:
        """``eval/...`` metrics of ``model`` and its rollout; ``eval/win_rate`` once
        :meth:`set_reference` has run."""
        rollout = self.sample(model)
        responses = rollout.get(K.RESPONSE_TEXT).tolist()
        score = rollout.get(K.SCORE)  # a prompt's responses on consecutive rows
        # the standard error of eval/score over the prompts (each prompt's mean score): the run
        # report's noise band for the held-out score (rlhf_torchrl.record.verdict)
        per_prompt = score.double().reshape(len(self.prompts), -1).mean(-1)  # (P,)
        metrics = {
            "eval/score": float(score.mean()),
            **({"eval/score_sem": float(per_prompt.std() / len(per_prompt) ** 0.5)}
               if len(per_prompt) > 1 else {}),
            "eval/response_length": float(rollout.get(K.RESPONSE_MASK).sum(-1).float().mean()),
            # responses cut by the length limit (no stop token): what overlong shaping lowers
            "eval/truncated_frac": float((~rollout.get(K.HAS_STOP)).float().mean()),
            "eval/distinct_1": distinct_n(responses, 1),
            "eval/distinct_2": distinct_n(responses, 2),
        }
        scores = rollout.get("scores") if "scores" in rollout.keys() else None
        weights = [w for _, w in getattr(self.scorer, "rewards", {}).values()]
        # each reward's own where the score is not it alone: beside another (a judge, VADER), or
        # weighted (0: scored, not trained on, as beside on-policy distillation's teacher)
        if scores is not None and (len(scores.keys()) > 1 or any(w != 1 for w in weights)):
            for name, value in scores.items():
                metrics[f"eval/scores/{name}"] = float(value.float().mean())
        if K.TURNS in rollout.keys(True):
            metrics["eval/turns_per_episode"] = float(rollout.get(K.TURNS).double().mean())
            metrics["eval/tool_calls_per_episode"] = float(rollout.get(K.TOOL_CALLS).double().mean())
        if self.accuracy is not None:
            correct, answers = self.verdicts(rollout)
            metrics["eval/accuracy"] = float(correct.float().mean())
            metrics.update(self.sample_metrics(correct, answers))
        if self._reference is not None:
            metrics["eval/win_rate"] = win_rate(self._judged(rollout), self._judged(self._reference))
            metrics["eval/reference_score"] = float(self._reference.get(K.SCORE).mean())
        return metrics, rollout

    def verdicts(self, rollout) -> tuple[torch.Tensor, list | None]:
        """Each response's verdict under the accuracy reward, (B,) bool: full marks (1.0; a
        checker's partial credit is not a correct answer); and the answer each gives, read by the
        reward's ``extract_answer`` (None where the reward has none).

        Args:
            rollout (tensordict.TensorDictBase): a scored rollout (:meth:`sample`).
        """
        correct = rollout.get(("scores", self.accuracy)) >= 1.0
        fn = getattr(self.scorer, "rewards", {}).get(self.accuracy, (None,))[0]
        extract = getattr(fn, "extract_answer", None)
        answers = None
        if extract is not None:
            answers = [extract(r) for r in rollout.get(K.RESPONSE_TEXT).tolist()]
        return correct, answers

    def sample_metrics(self, correct: torch.Tensor, answers: list | None) -> dict[str, float]:
        """``eval/pass@k`` and ``eval/maj@k`` (with answers) for each k of ``ks``, means over
        prompts, and the half-width of their 95% intervals over prompts (``..._ci95``, from two
        prompts on).

        Args:
            correct: (P * n,) each response's verdict, a prompt's ``n`` rows consecutive.
            answers: each response's answer (None: no maj@k).
        """
        n = self.samples_per_prompt
        per_prompt = correct.cpu().reshape(-1, n)  # (P, n)
        metrics = {}
        for k in self.ks:
            values = pass_at_k(per_prompt.sum(-1), n, k).tolist()
            metrics.update(_with_interval(f"eval/pass@{k}", values))
        if answers is not None:
            groups = [answers[i:i + n] for i in range(0, len(answers), n)]
            for k in self.ks:
                values = [majority_at_k(a, ok.tolist(), k) for a, ok in zip(groups, per_prompt)]
                metrics.update(_with_interval(f"eval/maj@{k}", values))
        return metrics


def _with_interval(name: str, values: list[float]) -> dict[str, float]:
    """``{name: mean, name_ci95: half-width}`` of per-prompt ``values`` (no interval under two)."""
    mean, half = mean_interval(values)
    return {name: mean} if half is None else {name: mean, f"{name}_ci95": half}


def rollout_samples(rollout, n: int | None = None, *, one_per_prompt: bool = False) -> list[dict]:
    """``{"prompt", "question", "response", "score"}`` of the first ``n`` rows of a rollout (all:
    None): the prompt as the policy read it (chat template applied) and, for reading, the last
    user message alone (the prompt again where the rollout has no messages); a multi-turn
    episode's response is its whole transcript, tool messages included.

    Args:
        rollout (tensordict.TensorDictBase): a scored rollout with its texts.
        n: the rows to take (None: all).
        one_per_prompt: only the first row of each prompt's group (``"group"``): with several
            samples per prompt, ``n`` prompts rather than ``n`` rows.
    """
    text = K.EPISODE_TEXT if K.EPISODE_TEXT in rollout.keys(True) else K.RESPONSE_TEXT
    prompts, responses = rollout.get(K.PROMPT_TEXT).tolist(), rollout.get(text).tolist()
    scores = rollout.get(K.SCORE).tolist()
    questions = prompts
    if K.PROMPT_MESSAGES in rollout.keys(True):
        questions = [m[-1]["content"] for m in rollout.get(K.PROMPT_MESSAGES).tolist()]
    rows = list(zip(prompts, questions, responses, scores))
    if one_per_prompt and K.GROUP in rollout.keys():
        groups = rollout.get(K.GROUP).tolist()
        rows = [row for i, row in enumerate(rows) if i == 0 or groups[i] != groups[i - 1]]
    return [{"prompt": p, "question": q, "response": r, "score": s} for p, q, r, s in rows[:n]]


def format_metrics(metrics: dict) -> str:
    """``score 0.348, win_rate 0.656, pass@4 0.625 +- 0.120, ...``: eval metrics on one line, an
    interval (``..._ci95``) beside its metric.

    Args:
        metrics: name to value.
    """
    from rlhf_torchrl.record.metrics import number

    return ", ".join(f"{k.removeprefix('eval/')} {number(v)}"
                     + (f" +- {number(metrics[k + '_ci95'])}" if k + "_ci95" in metrics else "")
                     for k, v in metrics.items() if not k.endswith("_ci95"))
