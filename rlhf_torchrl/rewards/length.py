"""Length shaping and per-source normalisation of the score: TensorDict modules that reshape
``"score"`` after the :class:`~rlhf_torchrl.rewards.scoring.Scorer` and before the KL shaping.

- :class:`OverlongPenalty`: DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), a penalty
  that grows linearly over the last ``buffer`` tokens before the length limit.
- :class:`PerSourceScoreNorm`: each response's score standardised by the running mean and
  standard deviation of its data source's scores (Welford's algorithm, merged a batch at a time),
  so that the sources of a mixture train on one scale; its state goes into checkpoints.
- :class:`ScoreTransforms`: several of these (and a transform of your own) in a row, as the
  trainer's ``reward_transform``.

Where they act, in the order the recipe runs them: the Scorer's score (reward model and
functions, weighted, minus the missing-EOS penalty) -> :class:`PerSourceScoreNorm` ->
:class:`OverlongPenalty` -> :class:`~rlhf_torchrl.objectives.kl_shaping.KLRewardShaper`
(``reward.whiten_scores``, ``reward.score_clip``, then the KL per token; the group baselines
compare the result). As in verl's ``DAPORewardManager`` and OpenRLHF, the penalty is part of the
score before any baseline or clip; it is added after the normalisation, so that the statistics
are the task's scores alone and the penalty keeps its size (``-penalty`` at the limit) in the
normalised units.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torch import nn

from rlhf_torchrl import keys as K
from rlhf_torchrl.data.prompt_sets import SOURCE_COLUMN
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.functional.length import batch_moments, merge_moments, overlong_penalty


class OverlongPenalty(TensorDictModuleBase):
    """DAPO's soft overlong punishment added to each response's score.

    ``score += penalty * R(|y|)`` with ``R`` of :func:`~rlhf_torchrl.functional.length.overlong_penalty`:
    0 up to ``max_length - buffer`` tokens, then linear down to ``-penalty`` at ``max_length``.
    ``|y|`` counts the policy's own tokens (``("masks", "response")``: the stop token included;
    in a multi-turn episode, its turns alone, not the tools' messages).

    Also writes, for the metrics (``reward/<name>``, the batch's mean): ``("reward_stats",
    "overlong_penalty")`` the penalty added, ``("reward_stats", "overlong_frac")`` 1 where the
    response is in the buffer (penalised), ``("reward_stats", "truncated_frac")`` 1 where it has
    ``max_length`` tokens or more (cut by the limit).

    Args:
        max_length: ``L_max``, the most tokens a response may have (``generation.max_new_tokens``).
        buffer: ``L_cache``, the tokens before ``max_length`` the penalty grows over,
            ``0 < buffer < max_length``.
        penalty: the penalty at ``max_length`` (DAPO: 1), ``>= 0``.

    Shapes: reads ``("masks", "response")`` (B, R) and ``"score"`` (B,); writes ``"score"`` (B,).

    Example:
        >>> td = TensorDict({"score": torch.zeros(3), ("masks", "response"):
        ...                  torch.arange(16).expand(3, 16) < torch.tensor([[10], [14], [16]])}, [3])
        >>> OverlongPenalty(max_length=16, buffer=4)(td)["score"]
        tensor([ 0.0000, -0.5000, -1.0000])
    """

    def __init__(self, max_length: int, buffer: int, penalty: float = 1.0):
        super().__init__()
        if not 0 < buffer < max_length:
            raise ConfigError(f"The overlong buffer of {buffer} tokens must be > 0 and below the "
                              f"{max_length} tokens a response may have: the penalty grows over "
                              "its last tokens.")
        if not penalty >= 0:
            raise ConfigError(f"The overlong penalty is {penalty}: give a number >= 0 (DAPO: 1).")
        self.max_length, self.buffer, self.penalty = int(max_length), int(buffer), float(penalty)
        self.in_keys = [K.RESPONSE_MASK, K.SCORE]
        self.out_keys = [K.SCORE, *((K.REWARD_STATS, name) for name in
                                    ("overlong_penalty", "overlong_frac", "truncated_frac"))]

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        K.require(td, *self.in_keys, what="OverlongPenalty")
        lengths = td.get(K.RESPONSE_MASK).sum(-1)  # (B,) the policy's own tokens
        penalty = overlong_penalty(lengths, self.max_length, self.buffer, self.penalty)
        score = td.get(K.SCORE)
        td.set(K.SCORE, score + penalty.to(score.dtype))
        td.set((K.REWARD_STATS, "overlong_penalty"), penalty)
        td.set((K.REWARD_STATS, "overlong_frac"), (lengths > self.max_length - self.buffer).float())
        td.set((K.REWARD_STATS, "truncated_frac"), (lengths >= self.max_length).float())
        return td


class PerSourceScoreNorm(TensorDictModuleBase):
    """Each response's score standardised by its data source's running statistics.

    For source ``s`` with running count ``n_s``, mean ``mu_s`` and ``M2_s`` (the sum of squared
    deviations) over every score seen so far, this batch's included:
    ``score <- (score - mu_s) / sqrt(M2_s / n_s + eps)``. The statistics are exact over the whole
    run (Welford's algorithm; each batch merged in by Chan et al.'s pairwise formula,
    :func:`~rlhf_torchrl.functional.length.merge_moments`), not an exponential average: every
    score weighs the same, whenever it came. They are updated before the batch is normalised (as
    Gymnasium's ``NormalizeReward``), so a source's first batch is standardised by its own
    statistics. Scores that are not finite are left out of the statistics (and stay as they are:
    the trainer's guard stops or skips them).

    A row's source is the value of ``source_key`` (a mixture's prompts carry their set's index in
    the field ``mixture_source``, :data:`~rlhf_torchrl.data.prompt_sets.SOURCE_COLUMN`): an index
    in ``[0, len(sources))``, or one of ``sources``' names. A rollout without that field is all
    of source 0 (one source: plain running normalisation of the score).

    Under torchrun every process's rows count: the batch's moments are summed over processes
    (``parallel``), so every process holds the same statistics, those of the global batch.

    The state (``count``, ``mean``, ``m2``: float64 buffers, one entry per source) is in
    :meth:`state_dict`, which the trainer saves in its checkpoints (``trainer.pt``) and restores
    on resume. :meth:`metrics` gives each source's running mean, standard deviation and count.

    Args:
        sources: the number of sources, or their names (the metrics use them; a row's field may
            hold the name or the index).
        source_key: the rollout entry holding each row's source.
        eps: added to the variance under the square root.
        parallel (rlhf_torchrl.distributed.DataParallel | None): the run's processes (None: one).

    Shapes: reads ``"score"`` (B,) and the rows' sources; writes ``"score"`` (B,) and
    ``("reward_stats", "unnormalized_score")`` (B,), the score it was given.

    Example:
        >>> norm = PerSourceScoreNorm(["math", "chat"])
        >>> td = TensorDict({"score": torch.tensor([1.0, 3.0, 10.0, 30.0])}, [4])
        >>> td.set(("data", "mixture_source"), NonTensorStack(*map(NonTensorData, [0, 0, 1, 1])))
        >>> norm(td)["score"]
        tensor([-1.,  1., -1.,  1.])
    """

    def __init__(self, sources: int | Sequence[str] = 1, *,
                 source_key: str | tuple[str, ...] = (K.DATA, SOURCE_COLUMN),
                 eps: float = 1e-8, parallel=None):
        super().__init__()
        if isinstance(sources, int):
            self.names = [str(i) for i in range(sources)]
        else:
            self.names = [str(name) for name in sources]
        if not self.names:
            raise ConfigError("PerSourceScoreNorm needs one source or more.")
        self.source_key, self.eps, self.parallel = source_key, float(eps), parallel
        n = len(self.names)
        for name in ("count", "mean", "m2"):
            self.register_buffer(name, torch.zeros(n, dtype=torch.float64))
        self.in_keys = [K.SCORE]
        self.out_keys = [K.SCORE, (K.REWARD_STATS, "unnormalized_score")]

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        K.require(td, K.SCORE, what="PerSourceScoreNorm")
        score = td.get(K.SCORE)  # (B,)
        index = self.source_index(td)  # (B,)
        self.update(score, index)
        mean, std = self.mean[index], torch.sqrt(self.m2[index] / self.count[index].clamp_min(1) + self.eps)
        td.set((K.REWARD_STATS, "unnormalized_score"), score.clone())
        td.set(K.SCORE, ((score.to(torch.float64) - mean) / std).to(score.dtype))
        return td

    def update(self, score: torch.Tensor, index: torch.Tensor) -> None:
        """Merge one batch's finite scores into each source's running statistics (every process's
        rows under torchrun).

        Args:
            score: (B,) the scores.
            index: (B,) each score's source index.
        """
        finite = torch.isfinite(score)
        count, mean, m2 = batch_moments(score[finite].cpu(), index[finite].cpu(), len(self.names))
        parallel = self.parallel
        if parallel is not None and parallel.enabled:
            # the global batch's moments: counts and sums first, then the squared deviations
            # from the global mean (exact, as one process holding every row would compute them)
            device = parallel._comm_device()
            sums = parallel.all_reduce(torch.stack([count, mean * count]).to(device)).cpu()
            count, mean = sums[0], sums[1] / sums[0].clamp_min(1)
            x, i = score[finite].cpu().to(torch.float64), index[finite].cpu()
            local = torch.zeros_like(count).index_add_(0, i, (x - mean[i]) ** 2)
            m2 = parallel.all_reduce(local.to(device)).cpu()
        count, mean, m2 = merge_moments(self.count, self.mean, self.m2, count, mean, m2)
        self.count.copy_(count), self.mean.copy_(mean), self.m2.copy_(m2)

    def source_index(self, td: TensorDictBase) -> torch.Tensor:
        """(B,) int64: each row's source index, read from ``source_key`` (absent: all 0).

        Args:
            td: the rollout.
        """
        if self.source_key not in td.keys(True, True):
            if len(self.names) > 1:
                raise ConfigError(
                    f"PerSourceScoreNorm has {len(self.names)} sources, and the rollout has no "
                    f"{self.source_key!r} entry naming each row's: a mixture's prompts carry it "
                    "(data.sources); set its source_key, or give one source.")
            return torch.zeros(td.shape[0], dtype=torch.long)
        values = td.get(self.source_key)
        values = values.tolist() if hasattr(values, "tolist") else list(values)
        index = []
        for value in values:
            i = self.names.index(value) if value in self.names else _as_index(value)
            if i is None or not 0 <= i < len(self.names):
                raise ConfigError(f"A row's source is {value!r}: PerSourceScoreNorm knows the "
                                  f"sources {self.names} (or their indices 0..{len(self.names) - 1}).")
            index.append(i)
        return torch.tensor(index, dtype=torch.long)

    def metrics(self) -> dict[str, float]:
        """Each source's running mean, standard deviation and count, as
        ``reward/source_<mean|std|count>/<name>``."""
        out = {}
        for i, name in enumerate(self.names):
            n = float(self.count[i])
            out[f"reward/source_mean/{name}"] = float(self.mean[i])
            out[f"reward/source_std/{name}"] = float(torch.sqrt(self.m2[i] / max(n, 1.0)))
            out[f"reward/source_count/{name}"] = n
        return out

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # saved statistics of another number of sources: one line (the chain's load reaches here)
        saved = state_dict.get(prefix + "count")
        if saved is not None and saved.shape != self.count.shape:
            raise ConfigError(
                f"The checkpoint's per-source score statistics hold {saved.shape[0]} sources, this "
                f"run has {len(self.names)}: resume with the data.sources it was run with.")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _as_index(value) -> int | None:
    """``value`` as an index (an int, a NumPy integer), or None (a bool, text, a float...)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


class ScoreTransforms(nn.Module):
    """Several score transforms applied in order to each scored rollout: the trainer's
    ``reward_transform`` (:class:`~rlhf_torchrl.trainers.ppo.PPOTrainer`). The state of those that
    are modules (:class:`PerSourceScoreNorm`'s statistics) is in :meth:`state_dict`, which the
    trainer checkpoints.

    Args:
        *transforms: TensorDict -> TensorDict callables (TorchRL ``Transform`` s, modules of this
            file, functions); None entries are skipped.

    Example:
        >>> transform = ScoreTransforms(PerSourceScoreNorm(2), OverlongPenalty(128, 32))
    """

    def __init__(self, *transforms: Callable | None):
        super().__init__()
        self.transforms = [t for t in transforms if t is not None]
        # the modules, registered so their state is saved (named by their place in the chain)
        self.modules_by_place = nn.ModuleDict({str(i): t for i, t in enumerate(self.transforms)
                                               if isinstance(t, nn.Module)})

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        for transform in self.transforms:
            out = transform(td)
            td = out if out is not None else td
        return td

    def metrics(self, batch: TensorDictBase | None = None) -> dict[str, float]:
        """The metrics of the transforms that keep statistics (:meth:`PerSourceScoreNorm.metrics`):
        an op for the trainer's ``post_steps_log`` stage
        (``trainer.register_op("post_steps_log", transforms.metrics)``).

        Args:
            batch: the iteration's batch (unused: the stage passes it).
        """
        out = {}
        for transform in self.transforms:
            if hasattr(transform, "metrics"):
                out.update(transform.metrics())
        return out

    def __len__(self) -> int:
        return len(self.transforms)
