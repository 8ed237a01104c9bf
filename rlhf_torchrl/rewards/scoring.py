"""Sequence scores: each response's one number.

- :func:`load_reward_function`: a reward function named by dotted path or file, checked on first use.
- :class:`Scorer`: combines reward models and functions with weights, applies the missing-EOS
  penalty, writes ``"score"`` (a TensorDict module).

Reward function contract: ``fn(prompts: list[str], responses: list[str], ...) -> list[float]``
(or a 1-D tensor/array), one finite float per response. ``prompts`` are the prompts as the policy
saw them (chat template applied), ``responses`` the decoded responses without special tokens. More
parameters are filled by name: ``tensordict`` receives the rollout TensorDict (keys in
:mod:`rlhf_torchrl.keys`); any other name receives that dataset column, one value per response
(``fn(prompts, responses, answer)`` gets each row's ``answer``); ``**kwargs`` receives every
column. A reward never receives ``None`` in place of a rollout.

Step rewards (process rewards): a function may instead return one list per response, one float
per step (``[[1.0, -1.0], [], [0.5]]``); ``steps`` then receives each response's steps as the
run splits them (:class:`~rlhf_torchrl.rewards.steps.StepSplit`), and each value goes to its
step's last token (:class:`~rlhf_torchrl.rewards.steps.StepRewards`, ``"step_reward"``).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import traceback
from collections.abc import Callable, Sequence

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase

from rlhf_torchrl import keys as K
from rlhf_torchrl.errors import ConfigError, MissingDependencyError, MissingFileError

RewardFn = Callable[..., Sequence[float]]


def load_reward_function(path: str) -> RewardFn:
    """Import ``package.module.function`` (or ``package.module:function``).

    Args:
        path: ``package.module.function`` or ``package.module:function``.
    """
    return load_callable(path, what="Reward function")


def load_callable(path: str, *, what: str = "Function") -> Callable:
    """The function ``path`` names: ``package.module.name`` or ``package.module:name`` (the module
    importable: installed, or its folder on ``PYTHONPATH``), or a Python file and a name in it,
    ``./my_rewards.py:name`` (relative to the working directory).

    Args:
        path: where the function is, in one of the forms above.
        what: what the function is, named in errors (e.g. ``"Reward function"``).

    Example:
        >>> load_callable("rlhf_torchrl.rewards.functions.gsm8k_correct").__name__
        'gsm8k_correct'
    """
    module_name, sep, attr = path.partition(":")
    if sep and module_name.endswith(".py"):
        return _load_from_file(path, module_name, attr, what)
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        from rlhf_torchrl.rewards import functions

        close = _close_names(path, functions)
        hint = (f"did you mean '{functions.__name__}.{close[0]}' (a reward this package ships)? "
                if close else "")
        raise ConfigError(
            f"{what} {path!r} is not a dotted path: {hint}write it as 'package.module.function' "
            "(or 'package.module:function'), or name a file and a function in it: "
            "'./my_rewards.py:function'."
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise MissingDependencyError(
            f"{what} {path!r}: cannot import module {module_name!r} ({e}). The module must be "
            "importable: install its package (pip install -e .), or put the folder that holds it "
            "on PYTHONPATH (PYTHONPATH=. for one in the working directory); or name the file: "
            f"'./{module_name.replace('.', '/')}.py:{attr}'."
        ) from e
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise MissingDependencyError(f"{what} {path!r}: module {module_name!r} has no callable "
                                     f"{attr!r}{_did_you_mean(attr, module)}")
    return fn


def _close_names(name: str, module) -> list[str]:
    """The public functions of ``module`` spelled like ``name``, closest first."""
    import difflib
    import inspect

    names = [n for n, v in vars(module).items() if not n.startswith("_") and inspect.isfunction(v)
             and v.__module__ == module.__name__]
    return difflib.get_close_matches(name, names, n=1, cutoff=0.7)


def _did_you_mean(name: str, module) -> str:
    """The end of a "has no function" line: a close name, or a full stop."""
    close = _close_names(name, module)
    return f": did you mean {close[0]!r}?" if close else "."


def _load_from_file(path: str, file: str, attr: str, what: str) -> Callable:
    """``attr`` of the Python file ``file``, run once as a module of its own (named after the
    file: ``rlhf_torchrl_user_<name>_<hash>``, so that pickle finds it in this process), whose folder
    also goes on ``sys.path`` for its imports."""
    import hashlib
    import sys

    full = os.path.abspath(os.path.expanduser(file))
    if not os.path.isfile(full):
        raise MissingFileError(f"{what} {path!r}: there is no file {full} (a file path is taken "
                               "from the working directory).")
    stem = os.path.splitext(os.path.basename(full))[0]
    name = f"rlhf_torchrl_user_{stem}_{hashlib.sha1(full.encode()).hexdigest()[:8]}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, full)
        module = importlib.util.module_from_spec(spec)
        folder = os.path.dirname(full)
        if folder not in sys.path:
            sys.path.append(folder)  # the file's own imports of its neighbours
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    fn = getattr(module, attr, None) if attr else None
    if fn is None or not callable(fn):
        raise MissingDependencyError(f"{what} {path!r}: {file} has no function {attr!r}"
                                     f"{_did_you_mean(attr, module) if attr else '.'}")
    return fn


def reward_arguments(name: str, fn: RewardFn, td: TensorDictBase, steps=None) -> dict:
    """The keyword arguments ``fn`` asks for by name, read from the rollout ``td``.

    ``tensordict`` gets the rollout, ``steps`` each response's steps (a list of strings per
    response), a dataset column's name gets that column (one value per row), ``**kwargs`` gets
    every column; a required parameter that is none of these is an error naming the columns there
    are.

    Args:
        name: the reward's name, for errors.
        fn: the reward function.
        td: the rollout, with its texts and dataset columns.
        steps (rlhf_torchrl.rewards.steps.StepRewards | None): splits the responses into steps
            (None: one step a line).
    """
    params = _parameters(fn)
    if params is None:  # no signature to read (some builtins): the two lists only
        return {}
    columns = set(td.get(K.DATA).keys()) if K.DATA in td.keys() else set()
    wanted = {}
    for param in list(params.values())[2:]:
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            wanted.update({c: c for c in columns if c not in wanted})
        elif param.kind is inspect.Parameter.VAR_POSITIONAL:
            continue
        elif param.name in ("tensordict", "steps") or param.name in columns:
            wanted[param.name] = param.name
        elif param.default is inspect.Parameter.empty:
            raise ConfigError(
                f"Reward {name!r} asks for {param.name!r}, which is not a dataset column: the "
                f"prompts carry {sorted(columns) or 'no columns'}. A reward function takes "
                "(prompts, responses), then by name 'tensordict' (the rollout) and dataset columns."
            )
    out = {k: td if k == "tensordict" else td.get((K.DATA, k)).tolist()
           for k in wanted if k != "steps"}
    if "steps" in wanted:
        from rlhf_torchrl.rewards.steps import StepSplit

        split = steps.split if steps is not None else StepSplit()
        out["steps"] = [split.texts(r) for r in td.get(K.RESPONSE_TEXT).tolist()]
    return out


class RewardError(RuntimeError):
    """A reward function raised; the message names it and the line that raised."""


def _call_reward(name: str, fn: RewardFn, td: TensorDictBase, device=None,
                 finite: bool = True, steps=None) -> torch.Tensor:
    """``fn`` on the rows of ``td`` as a (B,) float tensor, or (B, R) where it returns values per
    step (placed on tokens by ``steps``, a :class:`~rlhf_torchrl.rewards.steps.StepRewards`); a
    wrong type or count is an error, and so is a NaN/inf when ``finite`` (otherwise the value is
    left for the divergence guards, which name it and stop or skip the iteration:
    :class:`Scorer`'s ``allow_non_finite``)."""
    from rlhf_torchrl.rewards.steps import is_step_output

    prompts = td.get(K.PROMPT_TEXT).tolist()
    responses = td.get(K.RESPONSE_TEXT).tolist()
    kwargs = reward_arguments(name, fn, td, steps)
    try:
        out = fn(prompts, responses, **kwargs)
    except RewardError:  # says what went wrong already (a remote reward's service, say)
        raise
    except Exception as e:
        where = traceback.extract_tb(e.__traceback__)[-1]
        raise RewardError(f"Reward {name!r} raised {type(e).__name__}: {e} (at {where.filename}:"
                          f"{where.lineno}, in {where.name})") from e
    if is_step_output(out, name):  # one value per step: each at its step's last token
        if steps is None:
            raise ConfigError(f"Reward {name!r} returned values per step, which need the "
                              "policy's tokenizer to place: Scorer(..., steps=StepRewards(tokenizer)).")
        placed = steps.to_tokens(name, out, td, finite=finite)
        return placed if device is None else placed.to(device)
    try:
        out = torch.as_tensor(out, dtype=torch.float32, device=device).reshape(-1)
    except (TypeError, ValueError, RuntimeError):
        got = type(out).__name__
        if isinstance(out, (list, tuple)) and out:
            got += f" of {', '.join(sorted({type(v).__name__ for v in out}))}"
        raise RewardError(
            f"Reward {name!r} must return one float per response (a list, array or 1-D tensor); "
            f"got {got}."
        ) from None
    if out.numel() != len(responses):
        raise ConfigError(
            f"Reward {name!r} returned {out.numel()} values for {len(responses)} responses: "
            "it must return exactly one float per response."
        )
    if finite and not torch.isfinite(out).all():
        bad = (~torch.isfinite(out)).nonzero().flatten()[:5].tolist()
        raise ConfigError(
            f"Reward {name!r} returned non-finite values (NaN or inf) at rows {bad}: "
            "return finite floats (e.g. 0.0 for unscorable responses)."
        )
    return out


def _parameters(fn) -> dict[str, inspect.Parameter] | None:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


class Scorer(TensorDictModuleBase):
    """One scalar per response: a weighted sum of reward models and functions.

    ``score = sum_i w_i * reward_i(prompts, responses) - missing_eos_penalty * [no stop token]``.
    Reads the prompt/response text and ``has_stop_token``; writes ``"raw_score"`` (before the
    penalty), ``"score"`` (B,) and, for logging, one ``("scores", name)`` entry per reward.

    A reward that returns values per step (a list per response) is a process reward: ``steps``
    places each value on its step's last token, and ``"step_reward"`` (B, R) holds their weighted
    sum, which the shaper adds to the per-token reward; it is not part of ``"score"``, and its
    ``("scores", name)`` is each response's sum of step values.

    A reward that returns NaN or inf is refused, naming it and the rows
    (:class:`~rlhf_torchrl.errors.ConfigError`); with ``allow_non_finite`` the value is kept, for a
    trainer whose divergence guards name it, save the rollout and stop or skip the iteration
    (:func:`~rlhf_torchrl.trainers.guards.check_finite`; the recipe's ``guards.non_finite``).

    Args:
        rewards: name to ``(reward, weight)``, a reward being a :class:`RewardModel` or a function
            of ``(prompts, responses, ...)`` (:func:`reward_arguments`) returning one float per
            response.
        missing_eos_penalty: subtracted from the score of a response without a stop token (None or
            0: none).
        allow_non_finite: keep NaN or inf scores for the trainer's divergence guards instead of
            refusing them.
        steps (rlhf_torchrl.rewards.steps.StepRewards | None): splits responses into steps and
            places step values on tokens (the policy's tokenizer); needed by a reward that returns
            values per step.
        allow_no_rewards: accept an empty ``rewards``: every score is 0 (less the missing-EOS
            penalty), for a run whose reward is elsewhere (on-policy distillation's teacher,
            ``reward.teacher``).

    Example:
        >>> scorer = Scorer({"vader": (vader_compound, 1.0)}, missing_eos_penalty=1.0)
        >>> scorer(rollout)["score"].shape  # (B,)
    """

    def __init__(
        self,
        rewards: dict[str, tuple[RewardFn, float]],
        *,
        missing_eos_penalty: float | None = None,
        allow_non_finite: bool = False,
        steps=None,
        allow_no_rewards: bool = False,
    ):
        super().__init__()
        if not rewards and not allow_no_rewards:
            raise ConfigError(
                "No reward given: set a reward model (reward.model), reward functions "
                "(reward.functions=[package.module.fn]) and/or a teacher to distil "
                "(reward.teacher)."
            )
        self.rewards = dict(rewards)
        self.missing_eos_penalty, self.allow_non_finite = missing_eos_penalty, allow_non_finite
        self.steps = steps
        self.in_keys = [K.PROMPT_TEXT, K.RESPONSE_TEXT, K.HAS_STOP]
        self.out_keys = [K.RAW_SCORE, K.SCORE] + [("scores", n) for n in self.rewards]
        if steps is not None:
            self.out_keys.append(K.STEP_REWARD)

    def check(self, probe: TensorDictBase) -> None:
        """Call every reward once on a small rollout, so a broken one fails before any work.
        Raises the same clear errors as scoring, naming the reward.

        Args:
            probe: a small rollout with the layout of a real one (e.g.
                :func:`~rlhf_torchrl.data.rollout.probe_rollout`: real prompts and their dataset
                fields, made-up responses).
        """
        for name, (fn, _) in self.rewards.items():
            _call_reward(name, fn, probe, steps=self.steps)

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        K.require(td, *self.in_keys, what="Scorer")
        device = td.get(K.HAS_STOP).device  # scores live with the rollout (a text reward's go there)
        total = torch.zeros(td.shape[0], device=device)
        step_total = None  # (B, R): the process rewards, each step's value at its last token
        for name, (fn, weight) in self.rewards.items():
            value = _call_reward(name, fn, td, device, finite=not self.allow_non_finite,
                                 steps=self.steps)
            if value.dim() == 2:
                td.set(("scores", name), value.sum(-1))
                step_total = weight * value + (0 if step_total is None else step_total)
                continue
            td.set(("scores", name), value)
            total = total + weight * value
        if step_total is not None:
            td.set(K.STEP_REWARD, step_total)
        td.set(K.RAW_SCORE, total)
        score = total
        if self.missing_eos_penalty:
            score = score - self.missing_eos_penalty * (~td.get(K.HAS_STOP)).float()
        td.set(K.SCORE, score)
        return td
