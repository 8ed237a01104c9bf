"""The one-turn collector: TorchRL's ``LLMCollector`` over the prompt env (:mod:`rlhf_torchrl.envs.prompt_env`) and the
generation policy (:mod:`.backends.transformers`). :class:`RolloutCollector` turns each ragged,
lazily-stacked batch into the dense layout of :mod:`rlhf_torchrl.data.rollout` and truncates responses
after the first stop token.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack
from torchrl.collectors.llm import LLMCollector

from rlhf_torchrl import keys as K
from rlhf_torchrl.collectors.backends.transformers import _OnPolicyTransformersWrapper, sampler_of
from rlhf_torchrl.data.prompts import render_conversations
from rlhf_torchrl.data.rollout import build_rollout, to_rollout
from rlhf_torchrl.errors import ConfigError


class _OneTurnCollector(LLMCollector):
    """TorchRL's ``LLMCollector`` for episodes of one response (``StepCounter(max_steps=1)``).

    Every row is done after its step, so the next batch is a plain ``env.reset()`` (the next
    prompts, in the order upstream serves them). What upstream spends per batch besides that
    produces nothing a one-step episode keeps: ``step_and_maybe_reset``'s ``step_mdp`` and the
    merge of the reset rows into it, and two deep clones of the batch, each a loop over the rows
    of lazy stacks (the conversations deep-copied at every one). Here the policy's output is
    yielded as it is: ``_rollout_all`` builds a new stack each batch, and the prompts it carries
    are the loader's own copies (:func:`_collate_prompts`).

    The step itself only writes the next prompt (the full text), which the reset replaces: it is
    skipped where the env is :func:`make_generation_env`'s (a ``ChatEnv`` under the loader,
    ``StepCounter`` and ``InitTracker``), and run where a user's env adds transforms of its own.
    On tiny GPT-2 at batch 64 the collector's cost over a bare ``generate`` went from ~130 ms a
    batch to ~45 ms (1.3x to 1.1x of ``generate``'s time at 16 tokens; ``rlhf-torchrl bench
    collectors``).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the iterator's clone and its walk over every key for private ones (nothing private here)
        self.return_same_td = True
        self._exclude_private_keys = False
        self.steps_env = not _step_writes_nothing_kept(self.env)

    def _rollout_all(self) -> TensorDictBase:
        if self._shuttle is None:
            self._shuttle = self.env.reset()
        steps, collected = [], 0
        while collected < self.dialog_turns_per_batch:
            step = self.policy(self._shuttle)
            if self.steps_env:
                step = self.env.step(step)
            self._shuttle = self.env.reset()
            steps.append(step)
            collected += step.numel()
        out = lazy_stack(steps, -1)
        return out.view(-1) if self.flatten_data else out


def _step_writes_nothing_kept(env) -> bool:
    """Whether ``env`` is :func:`make_generation_env`'s: a plain ``ChatEnv`` whose transforms act
    at reset only (serving prompts, ending the episode, marking its start)."""
    from torchrl.envs import InitTracker, StepCounter, TransformedEnv
    from torchrl.envs.llm import ChatEnv
    from torchrl.envs.llm.transforms import DataLoadingPrimer

    if not isinstance(env, TransformedEnv) or type(env.base_env) is not ChatEnv:
        return False
    return all(type(t) in (DataLoadingPrimer, StepCounter, InitTracker) for t in _transforms(env))


def _transforms(env) -> list:
    """The transforms of a ``TransformedEnv``, in order."""
    from torchrl.envs import Compose

    return list(env.transform) if isinstance(env.transform, Compose) else [env.transform]


def _dense_prompt_source(env, policy, tokenizer):
    """The prompt loader of :func:`make_generation_env`'s env (its ``DataLoadingPrimer``) where the
    one-turn collector may skip TorchRL's env and wrapper objects and produce the same rollouts
    densely: the env is that function's (nothing of a user's on it), it renders the tokenizer's
    own chat template as :func:`~rlhf_torchrl.data.prompts.render_conversations` does, and the policy is
    :func:`~rlhf_torchrl.collectors.make_generation_policy`'s (or the vLLM backend's) wrapper
    itself, not a subclass. None otherwise."""
    from torchrl.envs.llm.transforms import DataLoadingPrimer

    if not _step_writes_nothing_kept(env) or type(policy) is not _OnPolicyTransformersWrapper:
        return None
    chat = env.base_env
    primers = [t for t in _transforms(env) if type(t) is DataLoadingPrimer]
    if (chat.input_mode != "text" or chat.system_prompt is not None or chat.data_key != "query"
            or chat.tokenizer is not tokenizer or tokenizer.chat_template is None
            or chat.template_kwargs != {"chat_template": tokenizer.chat_template}
            or len(primers) != 1 or primers[0].repeats not in (None, 0, 1)
            or policy.input_mode != "text" or not policy.pad_output or policy.num_samples
            or policy.return_log_probs):
        return None
    return primers[0]


def _env_batch_size(env, batch_size: int | None) -> int:
    """The rows of each batch: the environment's (a ``batch_size`` given too must agree)."""
    rows = int(env.batch_size[0]) if len(env.batch_size) else None
    if rows is None and batch_size is None:
        raise ConfigError("RolloutCollector: the environment has no batch size (env.batch_size is "
                          "empty): pass batch_size=, the rows of each rollout.")
    if batch_size is not None and rows is not None and batch_size != rows:
        raise ConfigError(f"RolloutCollector(batch_size={batch_size}) is not the environment's "
                          f"batch size, {rows} (the rows each reset serves): leave batch_size out, "
                          "the collector takes the environment's.")
    return rows if batch_size is None else batch_size


class RolloutCollector:
    """Iterable of dense rollouts: TorchRL's ``LLMCollector`` plus stop-token truncation.

    Each item is a TensorDict of ``batch_size=[B]`` with the keys of :func:`to_rollout`, plus the
    sampled tokens' ``("log_probs", "response")`` (and ``("entropy", "response")``) (B, R) fp32
    when the policy's sampler records them, and ``"state_value"`` (B, R, 1) fp32 when it records
    values (``make_generation_policy(value_head=...)``). The collector samples with the live
    policy weights (the wrapped model is the trained one).

    With ``seed``, row ``i`` of batch ``k`` is sampled from its own random stream, seeded by
    ``(seed, k, row_offset + i)`` (:func:`~rlhf_torchrl.collectors.sampling.row_stream_seeds`): a process that
    collects rows ``row_offset...`` of a global batch draws exactly the tokens a single process
    would for those rows.

    Each rollout carries ``"group"`` (B,) int64: ``(row_offset + i) // samples_per_prompt``, the
    same for the ``samples_per_prompt`` consecutive rows that answer one prompt (the env serves
    them so, :func:`make_generation_env`) and unique over the processes of a global batch.

    Args:
        env (torchrl.envs.EnvBase): the prompt env (:func:`make_generation_env`).
        policy (torch.nn.Module): the generation policy (:func:`make_generation_policy`).
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer (pad id, EOS,
            decoding).
        batch_size: the rows of each rollout (None: the environment's,
            ``make_generation_env(batch_size=...)`` on one process); one the environment does not
            serve is refused.
        stop_token_ids: the ids that end a response (None: the tokenizer's EOS).
        total_batches: rollouts to yield before stopping (-1: forever).
        seed: the per-row random streams' seed (None: torch's global generator).
        row_offset: this process's first row in the global batch.
        device: where rollouts are moved (None: left where they are made).
        start_batch: the index of the first batch (a resumed run; its env starts at the same
            batch, see :func:`make_generation_env`).
        samples_per_prompt: consecutive rows that answer one prompt (a group).
        dense: None (auto): with :func:`make_generation_env`'s env and
            :func:`make_generation_policy`'s policy, serve the env's prompts straight to the
            policy's ``generate`` and lay the rollout out densely (the same rollouts, without
            TorchRL's per-batch env reset and wrapper objects: tens of milliseconds a batch of
            64, which a tiny model's generation feels); otherwise, or with False, run TorchRL's
            ``LLMCollector`` over the env (a user's env transforms see every step). True: the
            dense path, or an error saying why it cannot run.

    Example:
        >>> collector = RolloutCollector(make_generation_env(prompts, tok, batch_size=16), policy,
        ...                              tokenizer=tok)
        >>> rollout = next(iter(collector))
        >>> rollout[("tokens", "response")].shape  # (16, R)
    """

    def __init__(
        self,
        env,
        policy,
        *,
        tokenizer,
        batch_size: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        total_batches: int = -1,
        seed: int | None = None,
        row_offset: int = 0,
        device: torch.device | str | None = None,
        start_batch: int = 0,
        samples_per_prompt: int = 1,
        dense: bool | None = None,
    ):
        self.tokenizer = tokenizer
        self.start_batch = start_batch
        self.batch_size = batch_size = _env_batch_size(env, batch_size)
        self.seed, self.row_offset, self.device = seed, row_offset, device
        if batch_size % samples_per_prompt or row_offset % samples_per_prompt:
            raise ConfigError(f"RolloutCollector: a batch of {batch_size} rows from row {row_offset} "
                             f"does not hold whole groups of {samples_per_prompt}.")
        self.samples_per_prompt = samples_per_prompt
        self.sampler = sampler_of(policy)  # draws the tokens (and records their log-probs)
        if seed is not None and self.sampler is None:
            raise ConfigError("RolloutCollector(seed=...) needs a policy from make_generation_policy "
                             "(its InverseCDFSampler draws the tokens from per-row streams).")
        self.records = self.sampler is not None and self.sampler.record
        self.value_recorder = getattr(policy, "value_recorder", None)
        self.stop_token_ids = list(stop_token_ids or [tokenizer.eos_token_id])
        self.total_batches = total_batches
        self.policy = policy
        self.prompt_source = None if dense is False else _dense_prompt_source(env, policy, tokenizer)
        if dense and self.prompt_source is None:
            raise ConfigError("RolloutCollector(dense=True) needs make_generation_env's env (no "
                              "transforms of your own, the tokenizer's chat template) and "
                              "make_generation_policy's policy: leave dense unset to use "
                              "TorchRL's LLMCollector over yours.")
        self.collector = None
        if self.prompt_source is not None:
            # TorchRL's collector resets the env when it is built (its carrier) and serves from
            # the next reset on: that first batch is drawn and never collected on either path
            env.reset()
        else:
            total = -1 if total_batches < 0 else total_batches * batch_size
            self.collector = _OneTurnCollector(
                env, policy=policy, dialog_turns_per_batch=batch_size, total_dialog_turns=total
            )

    def __iter__(self) -> Iterator[TensorDict]:
        from rlhf_torchrl.collectors.sampling import row_stream_seeds

        if self.records:
            self.sampler.pop()  # nothing recorded outside this loop belongs to its batches
        if self.value_recorder is not None:
            self.value_recorder.pop()
        batches = self._dense_batches() if self.prompt_source is not None else self._env_batches()
        rows = range(self.row_offset, self.row_offset + self.batch_size)
        for index in itertools.count(self.start_batch):
            if self.seed is not None:  # the streams of the batch the collector generates next
                self.sampler.set_streams(row_stream_seeds(self.seed, index, rows))
            rollout, generated = next(batches, (None, None))
            if rollout is None:
                return
            group_rows = torch.arange(self.row_offset, self.row_offset + rollout.shape[0])
            rollout.set(K.GROUP, group_rows // self.samples_per_prompt)
            if self.records or self.value_recorder is not None:
                self._add_sampling_record(rollout, generated)
            yield rollout if self.device is None else rollout.to(self.device)

    def _env_batches(self) -> Iterator[tuple[TensorDict, int]]:
        """(rollout, tokens generated) per batch of TorchRL's ``LLMCollector``."""
        for batch in self.collector:
            rollout = to_rollout(batch, pad_token_id=self.tokenizer.pad_token_id,
                                 stop_token_ids=self.stop_token_ids, tokenizer=self.tokenizer)
            yield rollout, batch.get(K.RESPONSE_TOKENS, as_padded_tensor=True).shape[-1]

    def _dense_batches(self) -> Iterator[tuple[TensorDict, int]]:
        """(rollout, tokens generated) per batch, the dense way: the rows a reset of the env would
        serve (its loader's, in the same order), rendered, sampled and laid out directly."""
        served = 0
        while self.total_batches < 0 or served < self.total_batches:
            # the primer's own step (private in TorchRL): one row per reset row, as a reset serves
            # them; tests/test_data.py compares both paths, so a TorchRL change shows up there
            prompts = self.prompt_source._load_from_dataloader(
                torch.ones(self.batch_size, dtype=torch.bool))
            messages = prompts.get("query").tolist()
            fields = prompts.get("fields").tolist() if "fields" in prompts.keys() else None
            prompt, mask, response = self.policy.sample_texts(
                render_conversations(self.tokenizer, messages))
            rollout = build_rollout(prompt, mask.bool(), response, tokenizer=self.tokenizer,
                                    pad_token_id=self.tokenizer.pad_token_id,
                                    stop_token_ids=self.stop_token_ids, messages=messages,
                                    fields=fields)
            served += 1
            yield rollout, response.shape[-1]

    def _add_sampling_record(self, rollout: TensorDict, generated: int) -> None:
        """Write what the sampling pass recorded for this batch (``generated`` tokens a row), 0 on
        pads: the sampled tokens' log-probs (and entropies) (B, R), and the values (B, R, 1) of a
        value recorder."""
        log_probs, entropies = self.sampler.pop() if self.records else (None, None)
        values = self.value_recorder.pop() if self.value_recorder is not None else None
        mask = rollout.get(K.RESPONSE_MASK)
        width = mask.shape[1]
        for key, recorded in ((K.LOG_PROB, log_probs), (K.ENTROPY, entropies), (K.VALUE, values)):
            if recorded is None:
                continue
            if recorded.shape != (rollout.shape[0], generated):
                raise RuntimeError(
                    f"The sampling pass recorded {tuple(recorded.shape)} {key} for "
                    f"{rollout.shape[0]} responses of {generated} tokens: the batch was not "
                    "generated in one call.")
            recorded = torch.where(mask, recorded[:, :width], 0.0)
            rollout.set(key, recorded.unsqueeze(-1) if key == K.VALUE else recorded)

    def shutdown(self) -> None:
        if self.collector is not None:
            self.collector.shutdown()
