"""The rollout in TorchRL's trajectory layout, where TorchRL's own value estimators run unchanged.

A rollout has ``batch_size=[B]`` and (B, R, ...) token entries. TorchRL's ``GAE``,
``TD0Estimator``, ``TDLambdaEstimator`` and ``VTrace`` read a trajectory instead: a TensorDict
whose last batch dimension is time, with ``state_value`` and, under ``"next"``, the ``reward``,
``done``, ``terminated`` and ``state_value`` of the step after. :func:`token_view` gives the
rollout in that layout, the policy's tokens as the time steps; :func:`merge_token_view` brings
what was written on it back into the rollout::

    view = token_view(rollout)                                # batch (B, R)
    GAE(gamma=1.0, lmbda=0.95, value_network=None)(view)      # TorchRL's, unchanged
    merge_token_view(rollout, view)                           # "advantage", "value_target" (B, R, 1)

On the policy's tokens that equals :class:`~rlhf_torchrl.objectives.advantages.ResponseGAE` with
``whiten_advantages=False`` (``tests/test_trajectory.py``; ``TD0Estimator`` is its ``lmbda=0``,
``TDLambdaEstimator`` the same ``lmbda``, ``VTrace`` on-policy its ``lmbda=1``), multi-turn
episodes included. ``VTrace`` also needs the current policy's log-prob of each step, which the
token-level actor cannot compute on a (B, R) batch: :class:`LogProbReader` reads it from an
entry of the view.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import InteractionType, TensorDictModuleBase

from rlhf_torchrl import functional as F
from rlhf_torchrl import keys as K
from rlhf_torchrl.errors import ConfigError


def token_view(rollout: TensorDictBase) -> TensorDict:
    """The rollout as TorchRL's trajectory: batch (B, R), the policy's tokens as time steps.

    Holds every tensor entry of response width (R) of ``rollout`` (tokens, masks, log-probs,
    ``("next", "reward")``, ``"state_value"``, ...; (B, R, 1) entries become one feature per step),
    plus ``("next", "done")`` and ``("next", "terminated")`` True at each row's last policy token
    only, ``("next", "state_value")`` (``V_{t+1}``, 0 after the last policy token) and
    ``"token_position"`` (the response position of each step). Per-response (B,) and text entries
    are left out; the prompt is not a time step.

    Args:
        rollout: a rollout (:func:`~rlhf_torchrl.data.rollout.to_rollout`'s layout), scored or not.

    Steps: step ``t`` of row ``i`` is its ``t``-th policy token (``("masks", "response")``), then
    its pads (mask False). A single-response rollout is right-padded: its steps are its positions,
    and the view shares the rollout's tensors. A multi-turn rollout has the environment's tokens
    between the policy's turns (``("masks", "observation")``): they are not steps of the view, so
    ``V_{t+1}`` after a turn's last token is the value at the first token of the next turn, as
    :func:`~rlhf_torchrl.functional.gae` has it (the rows are packed, a copy). Padded steps come
    after ``done`` and never reach a real step's estimate.

    What an estimator writes on the view goes back with :func:`merge_token_view`.

    Shapes: entries (B, R, ...) of ``rollout`` -> (B, R, ...) on a (B, R) batch.

    Example:
        >>> from torchrl.objectives.value import GAE
        >>> view = token_view(rollout)
        >>> GAE(gamma=1.0, lmbda=0.95, value_network=None)(view)["advantage"].shape  # (B, R, 1)
    """
    K.require(rollout, K.RESPONSE_MASK, K.REWARD, what="token_view")
    mask = rollout.get(K.RESPONSE_MASK).bool()  # (B, R), holes between the turns of an episode
    B, R = mask.shape
    holes = F.has_holes(mask)
    order = F.packing_order(mask)  # (B, R): the identity for a right-padded mask
    view = TensorDict(batch_size=[B, R], device=rollout.device)
    for key, value in rollout.items(True, True):
        if key in K.PROMPT_WIDTH or not isinstance(value, torch.Tensor) or value.shape[:2] != (B, R):
            continue
        view.set(key, _gather(value, order) if holes else value)
    done = F.last_token_mask(view.get(K.RESPONSE_MASK)).unsqueeze(-1)  # (B, R, 1)
    view.set(K.DONE, done)
    view.set(K.TERMINATED, done.clone())
    if K.VALUE in view.keys():
        values = torch.where(view.get(K.RESPONSE_MASK).unsqueeze(-1), view.get(K.VALUE), 0.0)
        next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], 1)
        view.set(("next", K.VALUE), torch.where(done, 0.0, next_values))
    view.set(K.TOKEN_POSITION, order)
    return view


def merge_token_view(rollout: TensorDictBase, view: TensorDictBase, keys=None) -> TensorDictBase:
    """Write entries of a :func:`token_view` back into ``rollout``, each at its token's position.

    ``keys`` (None: every entry the view has and the rollout does not, e.g. ``"advantage"`` and
    ``"value_target"`` after a TorchRL estimator) become (B, R, ...) entries of ``rollout``, 0 on
    the positions that are not the policy's tokens (pads, the environment's tokens), as the
    library's estimators write them. Returns ``rollout``.

    Args:
        rollout: the rollout the view was made from; written in place.
        view: the :func:`token_view` of ``rollout``, with the entries to bring back.
        keys (list | None): the view's entries to write back (None: those the rollout lacks).
    """
    if K.TOKEN_POSITION not in view.keys():
        raise ConfigError(f"merge_token_view needs a view made by token_view: {K.TOKEN_POSITION!r} "
                          "(each step's response position) is missing.")
    order = view.get(K.TOKEN_POSITION)
    mask = rollout.get(K.RESPONSE_MASK).bool()
    if keys is None:
        made = {K.DONE, K.TERMINATED, ("next", K.VALUE), K.TOKEN_POSITION}
        have = set(rollout.keys(True, True))
        keys = [k for k in view.keys(True, True) if k not in have and k not in made]
    for key in keys:
        value = _scatter(view.get(key), order)
        keep = mask.reshape(*mask.shape, *([1] * (value.ndim - 2)))
        rollout.set(key, torch.where(keep, value, torch.zeros_like(value)))
    return rollout


def _gather(value: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``value`` (B, R, ...) with each row's steps in ``order`` (B, R)."""
    index = order.reshape(*order.shape, *([1] * (value.ndim - 2))).expand_as(value)
    return value.gather(1, index)


def _scatter(value: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_gather`."""
    index = order.reshape(*order.shape, *([1] * (value.ndim - 2))).expand_as(value)
    return torch.zeros_like(value).scatter_(1, index, value)


class LogProbReader(TensorDictModuleBase):
    """A stand-in actor for TorchRL's ``VTrace`` on a :func:`token_view`: the current policy's
    log-prob of each step, read from ``key`` of the view (no model runs).

    ``VTrace``'s ratio is ``exp(log_pi - log_mu)``: ``log_pi`` from this reader, ``log_mu`` from
    ``VTrace``'s ``sample_log_prob`` key. With a trainer that recomputes the old log-probs and
    keeps the sampler's (``keep_sampler_log_probs``): ``key=("log_probs", "response")`` (the
    trained policy's) and ``sample_log_prob=("log_probs", "behaviour")`` (the sampler's).

    Args:
        key (tuple[str, str]): the view's entry read as ``log_pi`` (default: the policy's
            ``("log_probs", "response")``).

    Example:
        >>> vtrace = VTrace(gamma=1.0, value_network=None, actor_network=LogProbReader())
        >>> vtrace.set_keys(sample_log_prob=("log_probs", "behaviour"))
        >>> vtrace(token_view(rollout))
    """

    default_interaction_type = InteractionType.DETERMINISTIC
    num_samples = None

    def __init__(self, key=K.LOG_PROB):
        super().__init__()
        self.key = key
        self.in_keys, self.out_keys = [key], []

    def get_dist(self, td: TensorDictBase) -> _Recorded:
        return _Recorded(td.get(self.key))

    def _dist_sample(self, dist, interaction_type=None):
        return None  # the log-prob is recorded; there is nothing to sample

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        return td


class _Recorded:
    """A "distribution" whose log-prob of the step taken is known."""

    def __init__(self, log_prob: torch.Tensor):
        self._log_prob = log_prob

    def log_prob(self, _sample) -> torch.Tensor:
        return self._log_prob
