"""Sequence scores and per-token rewards.

- :class:`RewardModel`: a Hugging Face sequence classifier scoring ``prompt + response`` text.
- :func:`load_reward_function`: a reward function named by dotted path, checked on first use.
- :class:`Scorer`: combines reward models and functions with weights, applies the missing-EOS
  penalty, writes ``"score"`` (a TensorDict module).
- :class:`KLRewardShaper`: ``r[t] = -kl_coef * KL[t]`` on response tokens plus the score at the
  last one; constant or adaptive ``kl_coef``.

Reward function contract: ``fn(prompts: list[str], responses: list[str], ...) -> list[float]``
(or a 1-D tensor/array), one finite float per response. ``prompts`` are the prompts as the policy
saw them (chat template applied), ``responses`` the decoded responses without special tokens. More
parameters are filled by name: ``tensordict`` receives the rollout TensorDict (keys in
:mod:`rlhf_torchrl.keys`); any other name receives that dataset column, one value per response
(``fn(prompts, responses, answer)`` gets each row's ``answer``); ``**kwargs`` receives every
column. A reward never receives ``None`` in place of a rollout.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import traceback
from collections.abc import Callable, Sequence

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase

from . import functional as F
from . import keys as K
from .errors import ConfigError, MissingDependencyError, MissingFileError

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
        >>> load_callable("rlhf_torchrl.reward_functions.gsm8k_correct").__name__
        'gsm8k_correct'
    """
    module_name, sep, attr = path.partition(":")
    if sep and module_name.endswith(".py"):
        return _load_from_file(path, module_name, attr, what)
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(
            f"{what} {path!r} is not a dotted path: write it as 'package.module.function' (or "
            "'package.module:function'), or name a file and a function in it: './my_rewards.py:function'."
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
        raise MissingDependencyError(f"{what} {path!r}: module {module_name!r} has no callable {attr!r}.")
    return fn


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
        raise MissingDependencyError(f"{what} {path!r}: {file} has no function {attr!r}.")
    return fn


class RewardModel:
    """Scores each (conversation, response) with a sequence classifier (one logit = the score).

    What the reward model reads (:meth:`render`): with a chat template of its own, the prompt
    conversation plus the response as the assistant turn, rendered by that template (ending with
    the template's end-of-turn token where the response stopped, as in the chat data the model was
    trained on; left open where it was cut short); without one, the prompt as the policy saw it,
    the response, and the reward model's EOS token where the response stopped. Templated text is
    tokenised without adding special tokens (the template wrote them), raw text with them (a
    BERT-like model needs its ``[CLS]``). The text is encoded with the reward model's own tokenizer (right-padded, truncated from the left), so it
    may use another vocabulary than the policy; HF decoder classifiers read the score at the last
    non-pad token, encoders at their pooled token. Runs without grad.

    Args:
        model (torch.nn.Module): a sequence classifier with one label
            (:func:`~rlhf_torchrl.modules.load_sequence_classifier`).
        tokenizer (transformers.PreTrainedTokenizerBase): the reward model's own tokenizer.
        batch_size: texts scored per forward.
        max_length: the longest text in tokens, truncated from the left (None: the tokenizer's
            ``model_max_length``, if it has a real one).
        device: where it scores (None: where the model is).
        offload: the model lives on the CPU and visits ``device`` only while it scores.
    """

    def __init__(self, model, tokenizer, *, batch_size: int = 16, max_length: int | None = None,
                 device: torch.device | str | None = None, offload: bool = False):
        from .runtime import module_device

        self.device = torch.device(device) if device is not None else module_device(model)
        self.offload = offload
        self.model = model.eval().to("cpu" if offload else self.device)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length or getattr(tokenizer, "model_max_length", None)
        if self.max_length is not None and self.max_length > 100_000:
            self.max_length = None
        if tokenizer.pad_token_id is None:
            raise ConfigError(
                f"Reward model tokenizer {tokenizer.name_or_path!r} has no pad token and no "
                "EOS/UNK token to use as one: its vocabulary cannot be reconciled with batched "
                "scoring. Set `tokenizer.pad_token` before building the reward model."
            )
        # the score is read at the end: if a text must be cut, keep its end
        tokenizer.truncation_side = "left"
        # a trained reward model's shift that makes reference responses average zero
        # (rlhf_torchrl.reward_training); 0 for any other classifier
        self.offset = float(getattr(model.config, "reward_offset", 0.0) or 0.0)

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, dtype: str = "float32", **kwargs) -> RewardModel:
        from .modules.models import load_sequence_classifier

        model, tokenizer = load_sequence_classifier(name_or_path, dtype=dtype)
        return cls(model, tokenizer, **kwargs)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def render(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        messages: Sequence[list[dict]] | None = None,
        has_stop: Sequence[bool] | None = None,
    ) -> list[str]:
        """The exact text the reward model scores, one per response (see the class docstring).

        Args:
            prompts: the policy-rendered prompts.
            responses: the decoded responses.
            messages: the conversations the prompts render (needed with a chat template).
            has_stop: whether each response ended with its stop token (None: all did).
        """
        stopped = has_stop if has_stop is not None else [True] * len(responses)
        if self.has_chat_template:
            if messages is None:
                raise ConfigError(
                    "This reward model has a chat template: it needs the prompt conversations "
                    "(('messages', 'prompt') in the rollout) to render what it reads."
                )
            return [self._render_chat(conversation, response, s)
                    for conversation, response, s in zip(messages, responses, stopped)]
        eos = self.tokenizer.eos_token or ""
        return [p + r + (eos if s else "") for p, r, s in zip(prompts, responses, stopped)]

    def _render_chat(self, conversation: list[dict], response: str, stopped: bool) -> str:
        """The conversation with the response as the assistant turn: closed by the template's
        end-of-turn token if the response stopped, left open if it was cut short."""
        chat = [*conversation, {"role": "assistant", "content": response}]
        if not stopped and response:
            try:
                return self.tokenizer.apply_chat_template(chat, tokenize=False,
                                                          continue_final_message=True)
            except ValueError:  # a template that rewrites the content: close the turn
                pass
        return self.tokenizer.apply_chat_template(chat, tokenize=False)

    @torch.no_grad()
    def __call__(self, prompts: list[str], responses: list[str], tensordict: TensorDictBase) -> torch.Tensor:
        keys = tensordict.keys(True)
        texts = self.render(
            prompts, responses,
            messages=tensordict.get(K.PROMPT_MESSAGES).tolist() if K.PROMPT_MESSAGES in keys else None,
            has_stop=tensordict.get(K.HAS_STOP).tolist() if K.HAS_STOP in keys else None,
        )
        return self.score_texts(texts)

    @torch.no_grad()
    def score_texts(self, texts: list[str]) -> torch.Tensor:
        """The scores of texts already rendered (:meth:`render`), in chunks of ``batch_size``:
        (N,) float32, the offset subtracted (what a served reward model runs on its batches).

        Args:
            texts: rendered texts (:meth:`render`).
        """
        from .runtime import placed

        scores = []
        with placed(self.model, self.device, self.offload):
            for i in range(0, len(texts), self.batch_size):
                inputs = self.encode(texts[i : i + self.batch_size]).to(self.device)
                scores.append(self.model(**inputs).logits[:, 0].float())
        return torch.cat(scores) - self.offset

    def encode(self, texts: list[str]):
        """Token ids of rendered texts: no special tokens added to templated text (the template
        wrote them), the tokenizer's own around raw text.

        Args:
            texts: rendered texts (:meth:`render`).
        """
        return self.tokenizer(
            texts,
            return_tensors="pt",
            padding=True,
            truncation=self.max_length is not None,
            max_length=self.max_length,
            add_special_tokens=not self.has_chat_template,
        )


def reward_arguments(name: str, fn: RewardFn, td: TensorDictBase) -> dict:
    """The keyword arguments ``fn`` asks for by name, read from the rollout ``td``.

    ``tensordict`` gets the rollout, a dataset column's name gets that column (one value per row),
    ``**kwargs`` gets every column; a required parameter that is none of these is an error naming
    the columns there are.

    Args:
        name: the reward's name, for errors.
        fn: the reward function.
        td: the rollout, with its texts and dataset columns.
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
        elif param.name == "tensordict" or param.name in columns:
            wanted[param.name] = param.name
        elif param.default is inspect.Parameter.empty:
            raise ConfigError(
                f"Reward {name!r} asks for {param.name!r}, which is not a dataset column: the "
                f"prompts carry {sorted(columns) or 'no columns'}. A reward function takes "
                "(prompts, responses), then by name 'tensordict' (the rollout) and dataset columns."
            )
    return {k: td if k == "tensordict" else td.get((K.DATA, k)).tolist() for k in wanted}


class RewardError(RuntimeError):
    """A reward function raised; the message names it and the line that raised."""


def _call_reward(name: str, fn: RewardFn, td: TensorDictBase, device=None,
                 finite: bool = True) -> torch.Tensor:
    """``fn`` on the rows of ``td`` as a (B,) float tensor; a wrong type or count is an error, and
    so is a NaN/inf when ``finite`` (otherwise the value is left for the divergence guards, which
    name it and stop or skip the iteration: :class:`Scorer`'s ``allow_non_finite``)."""
    prompts = td.get(K.PROMPT_TEXT).tolist()
    responses = td.get(K.RESPONSE_TEXT).tolist()
    kwargs = reward_arguments(name, fn, td)
    try:
        out = fn(prompts, responses, **kwargs)
    except RewardError:  # says what went wrong already (a remote reward's service, say)
        raise
    except Exception as e:
        where = traceback.extract_tb(e.__traceback__)[-1]
        raise RewardError(f"Reward {name!r} raised {type(e).__name__}: {e} (at {where.filename}:"
                          f"{where.lineno}, in {where.name})") from e
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

    A reward that returns NaN or inf is refused, naming it and the rows
    (:class:`~rlhf_torchrl.errors.ConfigError`); with ``allow_non_finite`` the value is kept, for a
    trainer whose divergence guards name it, save the rollout and stop or skip the iteration
    (:func:`~rlhf_torchrl.guards.check_finite`; the recipe's ``guards.non_finite``).

    Args:
        rewards: name to ``(reward, weight)``, a reward being a :class:`RewardModel` or a function
            of ``(prompts, responses, ...)`` (:func:`reward_arguments`) returning one float per
            response.
        missing_eos_penalty: subtracted from the score of a response without a stop token (None or
            0: none).
        allow_non_finite: keep NaN or inf scores for the trainer's divergence guards instead of
            refusing them.

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
    ):
        super().__init__()
        if not rewards:
            raise ConfigError(
                "No reward given: set a reward model (reward.model) and/or reward functions "
                "(reward.functions=[package.module.fn])."
            )
        self.rewards = dict(rewards)
        self.missing_eos_penalty, self.allow_non_finite = missing_eos_penalty, allow_non_finite
        self.in_keys = [K.PROMPT_TEXT, K.RESPONSE_TEXT, K.HAS_STOP]
        self.out_keys = [K.RAW_SCORE, K.SCORE] + [("scores", n) for n in self.rewards]

    def check(self, probe: TensorDictBase) -> None:
        """Call every reward once on a small rollout, so a broken one fails before any work.
        Raises the same clear errors as scoring, naming the reward.

        Args:
            probe: a small rollout with the layout of a real one (e.g.
                :func:`~rlhf_torchrl.rollout.probe_rollout`: real prompts and their dataset
                fields, made-up responses).
        """
        for name, (fn, _) in self.rewards.items():
            _call_reward(name, fn, probe)

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        K.require(td, *self.in_keys, what="Scorer")
        device = td.get(K.HAS_STOP).device  # scores live with the rollout (a text reward's go there)
        total = torch.zeros(td.shape[0], device=device)
        for name, (fn, weight) in self.rewards.items():
            value = _call_reward(name, fn, td, device, finite=not self.allow_non_finite)
            td.set(("scores", name), value)
            total = total + weight * value
        td.set(K.RAW_SCORE, total)
        score = total
        if self.missing_eos_penalty:
            score = score - self.missing_eos_penalty * (~td.get(K.HAS_STOP)).float()
        td.set(K.SCORE, score)
        return td


class FixedKLController:
    """A constant KL coefficient (same interface as TorchRL's ``AdaptiveKLController``).

    Args:
        init_kl_coef: the coefficient.
    """

    def __init__(self, init_kl_coef: float):
        self.coef = init_kl_coef

    def update(self, kl_values=None) -> float:
        return self.coef


def make_kl_controller(kl_coef: float, target: float | None = None, horizon: int = 10000):
    """Constant ``kl_coef``, or TorchRL's ``AdaptiveKLController`` when ``target`` is set.

    Adaptive (Ziegler et al. 2019, §2.2): ``e = clip(KL / target - 1, -0.2, 0.2)``,
    ``kl_coef *= 1 + e * n / horizon`` with ``n`` the number of samples in the batch. TorchRL's
    ``update`` expects the per-sample KL *rewards* ``-kl_coef * KL``, which
    :class:`KLRewardShaper` passes.

    Args:
        kl_coef: the (initial) KL coefficient.
        target: the KL per response, in nats, the adaptive controller aims for (None: constant).
        horizon: the adaptive controller's horizon, in samples.
    """
    if target is None:
        return FixedKLController(kl_coef)
    from torchrl.data.llm.utils import AdaptiveKLController

    if kl_coef <= 0:
        raise ConfigError("The adaptive KL controller needs kl_coef > 0 to start from.")
    return AdaptiveKLController(init_kl_coef=kl_coef, target=target, horizon=horizon)


class KLRewardShaper(TensorDictModuleBase):
    """Per-token rewards from scores and the KL to the reference.

    ``KL[t] = estimator(log_prob[t], ref_log_prob[t])`` on response tokens,
    ``r[t] = -kl_coef * KL[t] + score * [t == last]``. Optionally whitens (``whiten_scores``, mean
    kept) and clips (``score_clip``) the scores first. Writes ``("kl", "response")`` (B, R),
    ``("next", "reward")``, ``("next", "non_score_reward")``, ``("next", "done")``,
    ``("next", "terminated")`` (B, R, 1), ready for GAE. A multi-turn rollout's
    ``"turn_reward"`` (B, R) (the tools' rewards, each at the last token of its turn) is added to
    the reward. Also writes ``"shaped_score"`` (B,): the reward without its KL part, summed over
    the response (the whitened, clipped score plus the turn rewards), which the group baselines
    compare.

    Args:
        kl_controller (FixedKLController | torchrl.data.llm.utils.AdaptiveKLController): owns
            ``kl_coef`` (:func:`make_kl_controller`).
        kl_estimator: ``k1``, ``k2`` or ``k3`` (:func:`~rlhf_torchrl.functional.kl_estimate`).
        whiten_scores: whiten the scores over the batch first, keeping their mean.
        score_clip: clip the scores to ``[-score_clip, score_clip]`` first (None: no clip).

    Unlike TorchRL's ``KLRewardTransform``, the score enters once, at the last response token, and
    nothing is put on prompt tokens.
    """

    def __init__(
        self,
        kl_controller,
        *,
        kl_estimator: str = "k1",
        whiten_scores: bool = False,
        score_clip: float | None = None,
    ):
        super().__init__()
        self.kl_estimator = F.check_kl_estimator(kl_estimator)
        self.kl_controller = kl_controller
        self.whiten_scores = whiten_scores
        self.score_clip = score_clip
        self.in_keys = [K.LOG_PROB, K.REF_LOG_PROB, K.RESPONSE_MASK, K.SCORE]
        self.out_keys = [K.KL, K.REWARD, K.NON_SCORE_REWARD, K.DONE, K.TERMINATED, K.SHAPED_SCORE]

    @property
    def kl_coef(self) -> float:
        return float(self.kl_controller.coef)

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        K.require(td, *self.in_keys, what="KLRewardShaper")
        mask = td.get(K.RESPONSE_MASK)
        score = td.get(K.SCORE)
        if self.whiten_scores and score.numel() > 1:
            score = F.masked_whiten(score, torch.ones_like(score, dtype=torch.bool), shift_mean=False)
        if self.score_clip is not None:
            score = score.clamp(-self.score_clip, self.score_clip)
        kl = F.kl_estimate(td.get(K.LOG_PROB), td.get(K.REF_LOG_PROB), self.kl_estimator) * mask
        reward, non_score = F.per_token_rewards(score, kl, mask, self.kl_coef)
        shaped_score = torch.where(mask.any(-1), score, torch.zeros_like(score))  # as in the reward
        turn_reward = td.get(K.TURN_REWARD, None)
        if turn_reward is not None:  # a multi-turn episode: the tools' rewards, turn by turn
            turn_reward = torch.where(mask, turn_reward, torch.zeros_like(turn_reward))
            reward = reward + turn_reward
            shaped_score = shaped_score + turn_reward.sum(-1)
        done = F.last_token_mask(mask).unsqueeze(-1)
        # summed here, not recovered as reward - KL: (s + k) - k rounds, and equal scores must stay
        # equal for the group baselines and the group filter
        td.set(K.SHAPED_SCORE, shaped_score)
        td.set(K.KL, kl)
        td.set(K.REWARD, reward.unsqueeze(-1))
        td.set(K.NON_SCORE_REWARD, non_score.unsqueeze(-1))
        td.set(K.DONE, done)
        td.set(K.TERMINATED, done.clone())
        return td

    def update_kl_coef(self, td: TensorDictBase) -> float:
        """Adapt ``kl_coef`` to the KL of this rollout (no-op for a constant coefficient).

        Args:
            td: the shaped rollout, with ``("kl", "response")``.
        """
        per_sample = td.get(K.NON_SCORE_REWARD).squeeze(-1).sum(-1)  # -kl_coef * KL(seq)
        if not math.isfinite(float(per_sample.sum())):
            return self.kl_coef
        return float(self.kl_controller.update(per_sample.tolist()))
