"""Partial rollouts: a response longer than a per-iteration token budget is paused and continued in
later iterations by newer weights, so that the longest response of a batch never holds it up.

As Kimi k1.5 ("Partial Rollouts for Long CoT RL", arXiv 2501.12599), slime's partial rollout and
MindSpeed-RL's synchronous one do it: generation runs in rounds of at most ``segment_tokens``
tokens per response; each round samples every response in flight (the paused ones first), fills
the free slots with new prompts, and sets aside the responses that finished (a stop token, or
``max_new_tokens`` in all). An iteration takes the first ``batch_size`` finished responses; the
ones still going are paused and continue in the next iteration's first round, by the weights of
that iteration. A round costs at most ``segment_tokens`` decoding steps, where a batch of whole
responses costs as many as its longest one.

A response's tokens can thus come from several policy versions. Each token keeps the version that
sampled it (``("policy_versions", "response")``) and the log-prob it was sampled with
(``("log_probs", "response")``); the trainer recomputes the old log-probs with its current weights
and the sampler's weight the loss (``ppo.tis_cap``, ``ppo.off_policy_correction``), as under
``collection.overlap >= 1``.

Random streams: a response's segment ``s`` (its ``s``-th round) is drawn from the stream of
``(seed, batch, row, segment=s)`` (:func:`~rlhf_torchrl.collectors.sampling.row_stream_seeds`; segment 0 is
the whole-response stream), so its tokens do not depend on the responses beside it. Which
responses share a round does depend on the process's share of the batch: a run is reproducible,
and resumes exactly, for a given number of processes, not across numbers of processes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict
from torch.nn.utils.rnn import pad_sequence

from rlhf_torchrl import functional as F
from rlhf_torchrl import keys as K
from rlhf_torchrl.collectors.backends.transformers import sampler_of
from rlhf_torchrl.data.rollout import build_rollout
from rlhf_torchrl.envs.prompt_env import check_group_sizes
from rlhf_torchrl.errors import ConfigError

#: where a saved response stands: not started, in flight (paused), finished and not yet trained on
_QUEUES = ("fresh", "running", "finished")


@dataclass
class _Response:
    """One response as it grows: its prompt, tokens so far, and what each token was sampled with."""

    batch: int  # the global batch that served its prompt
    row: int  # its row in that global batch (its random streams are keyed by both)
    prompt: list[int]
    messages: list
    fields: dict
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    segments: int = 0  # rounds that sampled it
    stopped: bool = False
    done: bool = False


class PartialRolloutCollector:
    """Rollouts of ``batch_size`` finished responses, sampled ``segment_tokens`` tokens per round.

    ``env`` serves prompts and ``policy`` samples: its ``generate_tokens`` continues token rows, as
    the later turns of :class:`~rlhf_torchrl.collectors.MultiTurnCollector` do. TorchRL's
    ``LLMCollector`` samples whole responses per env step, so the rounds call ``generate_tokens``
    themselves; the env, the wrapper, its sampler and stop tokens are the single-response path's.

    A round holds at most ``batch_size`` responses in flight: the paused ones, then new groups of
    ``samples_per_prompt`` while they fit. A group is finished when all its responses are, and
    groups are trained on whole, in the order they finished. Rows are drawn from per-(row,
    segment) streams seeded from ``seed``. Iteration ``k`` (from ``start_batch``) samples with
    policy version ``k``: the trainer's weights after ``k`` updates.

    Each rollout has the layout of :class:`~rlhf_torchrl.collectors.RolloutCollector`'s, plus
    ``("policy_versions", "response")`` (B, R) int64 (0 on pads), ``"policy_version"`` (B,) the
    oldest of a row's versions, and ``("partial", "segments")`` (B,) int64. Entropies and values
    are not recorded: the trainer recomputes them.

    Resume: :meth:`pending` returns one TensorDict, every response not yet trained on (not
    started, paused, finished) and the next prompt batch; a collector built with
    ``state=`` that TensorDict, over an env that starts at :func:`resume_batch`, continues as
    this one would have.

    Args:
        env (torchrl.envs.EnvBase): the prompt env
            (:func:`~rlhf_torchrl.collectors.make_generation_env`: its batches of ``batch_size``
            rows, groups of ``samples_per_prompt`` consecutive rows).
        policy (torch.nn.Module): ``make_generation_policy``'s or the vLLM one.
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer.
        max_new_tokens: a response's whole budget, in tokens.
        segment_tokens: tokens a response is sampled per round before it pauses.
        seed: the per-(row, segment) streams' seed.
        batch_size: finished responses per rollout (None: the env's).
        row_offset: this process's first row of each global batch.
        samples_per_prompt: consecutive rows that answer one prompt (a group).
        stop_token_ids: the ids that end a response (None: the tokenizer's EOS).
        start_batch: the trainer's iterations done (a resumed run).
        device (torch.device | str | None): where rollouts are moved (None: left where made).
        state: :meth:`pending`'s TensorDict from a checkpoint (None: a fresh start).

    Example:
        >>> env = make_generation_env(prompts, tok, batch_size=8, start_batch=0)
        >>> collector = PartialRolloutCollector(env, policy, tokenizer=tok, max_new_tokens=64,
        ...                                     segment_tokens=16, seed=0)
        >>> rollout = next(iter(collector))  # 8 finished responses, some begun in earlier rounds
    """

    def __init__(self, env, policy, *, tokenizer, max_new_tokens: int, segment_tokens: int,
                 seed: int, batch_size: int | None = None, row_offset: int = 0,
                 samples_per_prompt: int = 1, stop_token_ids: Sequence[int] | None = None,
                 start_batch: int = 0, device=None, state: TensorDict | None = None):
        rows = int(env.batch_size[0]) if len(env.batch_size) else batch_size
        if batch_size is not None and batch_size != rows:
            raise ConfigError(f"PartialRolloutCollector(batch_size={batch_size}) is not the "
                              f"environment's batch size, {rows}: leave batch_size out.")
        check_group_sizes(rows, samples_per_prompt)
        if not 1 <= segment_tokens < max_new_tokens:
            raise ConfigError(f"segment_tokens={segment_tokens} (collection.partial_rollout_tokens) "
                              f"must be in [1, max_new_tokens={max_new_tokens}): a response "
                              "within one segment is never paused.")
        self.sampler = sampler_of(policy)
        if self.sampler is None or not self.sampler.record:
            raise ConfigError("PartialRolloutCollector needs a policy whose sampler records log-probs "
                              "(make_generation_policy(record_log_probs=True), or the vLLM one).")
        if getattr(policy, "value_recorder", None) is not None:
            raise ConfigError("Partial rollouts do not read values off the sampling pass (a "
                              "response's values change with the weights): build the policy "
                              "without value_head.")
        self.env, self.policy, self.tokenizer = env, policy, tokenizer
        self.batch_size, self.group, self.row_offset = rows, samples_per_prompt, row_offset
        self.max_new_tokens, self.segment_tokens, self.seed = max_new_tokens, segment_tokens, seed
        self.stop_token_ids = list(stop_token_ids or [tokenizer.eos_token_id])
        self.start_batch, self.device = start_batch, device
        self.fresh: deque[list[_Response]] = deque()  # groups served, not started
        self.running: list[list[_Response]] = []  # groups in flight (paused between rounds)
        self.finished: deque[list[_Response]] = deque()  # groups done, not yet trained on
        self.next_batch = start_batch  # the prompt batch the env serves next
        self.version = start_batch  # the policy version the next rollout is sampled with
        if state is not None:
            self._load(state)

    # ---- the rounds -----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[TensorDict]:
        self.sampler.pop()  # nothing recorded outside this loop belongs to its rounds
        while True:
            version = self.version
            while len(self.finished) * self.group < self.batch_size:
                self._round(version)
            groups = [self.finished.popleft() for _ in range(self.batch_size // self.group)]
            rollout = self._to_rollout(groups)
            self.version = version + 1  # before the yield: what pending() saves meanwhile
            yield rollout if self.device is None else rollout.to(self.device)

    def _round(self, version: int) -> None:
        """Sample up to ``segment_tokens`` more tokens of every response in flight, the free slots
        first filled with new groups; set aside the groups that finished."""
        rows = [r for group in self.running for r in group if not r.done]
        while len(rows) + self.group <= self.batch_size:
            if not self.fresh:
                self._serve()
            group = self.fresh.popleft()
            self.running.append(group)
            rows += group
        self._sample(rows, version)
        going = []
        for group in self.running:
            (self.finished.append(group) if all(r.done for r in group) else going.append(group))
        self.running = going

    def _serve(self) -> None:
        """The env's next batch of prompts, as groups of fresh responses."""
        batch = self.env.reset()
        texts = batch.get(K.PROMPT_TEXT).tolist()
        messages = batch.get("query").tolist() if "query" in batch.keys() else [[]] * len(texts)
        fields = batch.get("fields").tolist() if "fields" in batch.keys() else [{}] * len(texts)
        # the chat template wrote the special tokens: the wrapper's tokenisation (add_special_tokens=False)
        prompts = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        rows = [_Response(self.next_batch, self.row_offset + i, list(p), m, f)
                for i, (p, m, f) in enumerate(zip(prompts, messages, fields))]
        self.fresh.extend(rows[i:i + self.group] for i in range(0, len(rows), self.group))
        self.next_batch += 1

    def _sample(self, rows: list[_Response], version: int) -> None:
        """One segment of each of ``rows``, sampled together: each row from its own stream and cut
        at its own budget (``segment_tokens``, or less where ``max_new_tokens`` is near), so a row's
        tokens do not depend on the rows beside it."""
        from rlhf_torchrl.collectors.sampling import row_stream_seeds

        pad = self.tokenizer.pad_token_id
        sequences = [torch.tensor(r.prompt + r.tokens) for r in rows]
        input_ids = pad_sequence(sequences, batch_first=True, padding_value=pad, padding_side="left")
        attention = pad_sequence([torch.ones_like(s) for s in sequences], batch_first=True,
                                 padding_side="left")
        budgets = [min(self.segment_tokens, self.max_new_tokens - len(r.tokens)) for r in rows]
        self.sampler.set_streams([row_stream_seeds(self.seed, r.batch, [r.row], segment=r.segments)[0]
                                  for r in rows])
        new = self.policy.generate_tokens(input_ids, attention, max(budgets))
        log_probs = self.sampler.pop()[0]  # (B, T) fp32, the sampled tokens' (after the temperature)
        new, mask, stopped = F.truncate_after_stop(new, self.stop_token_ids, pad)  # (B, T), right-padded
        for j, r in enumerate(rows):
            n, stop = int(mask[j].sum()), bool(stopped[j])  # up to and with the stop token
            if n > budgets[j]:  # past the row's own budget: cut there, before any stop token
                n, stop = budgets[j], False
            r.tokens += new[j, :n].tolist()
            r.log_probs += log_probs[j, :n].tolist()
            r.versions += [version] * n
            r.segments += 1
            r.stopped = stop
            r.done = stop or len(r.tokens) >= self.max_new_tokens

    def _to_rollout(self, groups: list[list[_Response]]) -> TensorDict:
        """The rollout layout of :func:`~rlhf_torchrl.data.rollout.build_rollout` for ``groups``."""
        rows = [r for group in groups for r in group]
        pad = self.tokenizer.pad_token_id
        prompt = _padded([r.prompt for r in rows], pad, torch.long, left=True)  # (B, P) left-padded
        prompt_mask = _padded([[True] * len(r.prompt) for r in rows], False, torch.bool, left=True)
        rollout = build_rollout(
            prompt, prompt_mask, _padded([r.tokens for r in rows], pad, torch.long),
            stop_token_ids=self.stop_token_ids, pad_token_id=pad, tokenizer=self.tokenizer,
            messages=[r.messages for r in rows], fields=[r.fields for r in rows])
        n = len(rows)
        rollout.update({  # (B, R) right-padded, 0 on pads (the same width: every token counts)
            K.LOG_PROB: _padded([r.log_probs for r in rows], 0.0, torch.float32),
            K.TOKEN_VERSION: _padded([r.versions for r in rows], 0, torch.long),
            K.POLICY_VERSION: torch.tensor([min(r.versions) for r in rows]),
            K.SEGMENTS: torch.tensor([r.segments for r in rows]),
            K.GROUP: (self.row_offset + torch.arange(n)) // self.group,
        })
        return rollout

    # ---- resume ---------------------------------------------------------------------------------
    def pending(self) -> list[TensorDict]:
        """This process's responses not yet trained on, and where the prompts continue: one
        TensorDict (``rows``, ``next_batch``), which a checkpoint keeps
        (:meth:`~rlhf_torchrl.trainers.ppo.PPOTrainer.pending_rollouts`)."""
        queued = [(q, group) for q, groups in enumerate((self.fresh, self.running, self.finished))
                  for group in groups]
        rows = [(q, r) for q, group in queued for r in group]
        table = TensorDict(batch_size=[len(rows)])
        if rows:
            table.update({
                "queue": torch.tensor([q for q, _ in rows]),
                "batch": torch.tensor([r.batch for _, r in rows]),
                "row": torch.tensor([r.row for _, r in rows]),
                "prompt": _padded([r.prompt for _, r in rows], 0, torch.long),
                "prompt_length": torch.tensor([len(r.prompt) for _, r in rows]),
                "tokens": _padded([r.tokens for _, r in rows], 0, torch.long, empty=True),
                "length": torch.tensor([len(r.tokens) for _, r in rows]),
                "log_probs": _padded([r.log_probs for _, r in rows], 0.0, torch.float32, empty=True),
                "versions": _padded([r.versions for _, r in rows], 0, torch.long, empty=True),
                "segments": torch.tensor([r.segments for _, r in rows]),
                "stopped": torch.tensor([r.stopped for _, r in rows]),
                "done": torch.tensor([r.done for _, r in rows]),
                "messages": NonTensorStack(*(NonTensorData(r.messages) for _, r in rows)),
                "fields": NonTensorStack(*(NonTensorData(r.fields) for _, r in rows)),
            })
        return [TensorDict({"rows": table, "next_batch": torch.tensor(self.next_batch),
                            "version": torch.tensor(self.version)}, batch_size=[])]

    def _load(self, state: TensorDict) -> None:
        if int(state.get("version")) != self.start_batch:
            raise ConfigError(f"The saved partial rollouts were paused before iteration "
                              f"{int(state.get('version'))}, not {self.start_batch}: resume from the "
                              "checkpoint they were saved with.")
        self.next_batch = int(state.get("next_batch"))
        table = state.get("rows")
        if table.shape[0] == 0:
            return
        messages, fields = table.get("messages").tolist(), table.get("fields").tolist()
        queues = (self.fresh, self.running, self.finished)
        rows = []
        for i in range(table.shape[0]):
            n, p = int(table.get("length")[i]), int(table.get("prompt_length")[i])
            rows.append((int(table.get("queue")[i]), _Response(
                int(table.get("batch")[i]), int(table.get("row")[i]), table.get("prompt")[i, :p].tolist(),
                messages[i], fields[i], table.get("tokens")[i, :n].tolist(),
                table.get("log_probs")[i, :n].tolist(), table.get("versions")[i, :n].tolist(),
                int(table.get("segments")[i]), bool(table.get("stopped")[i]),
                bool(table.get("done")[i]))))
        for i in range(0, len(rows), self.group):  # a group's rows are saved together
            queues[rows[i][0]].append([r for _, r in rows[i:i + self.group]])

    def shutdown(self) -> None:
        self.env.close(raise_if_closed=False)


def resume_batch(state: TensorDict) -> int:
    """The prompt batch the env of a collector resumed from ``state`` starts at."""
    return int(state.get("next_batch"))


def current_tokens(rollout: TensorDict, version: int) -> tuple[TensorDict, torch.Tensor]:
    """The rows of ``rollout`` that hold tokens sampled by ``version``, and those tokens (B', R)
    bool: what the on-policy check can compare with the trainer's forward at that version (a
    paused response's earlier tokens came from older weights)."""
    tokens = rollout.get(K.RESPONSE_MASK) & (rollout.get(K.TOKEN_VERSION) == version)
    rows = tokens.any(-1)
    return rollout[rows], tokens[rows]


def _padded(rows: list[list], value, dtype: torch.dtype, *, left: bool = False,
            empty: bool = False) -> torch.Tensor:
    """``rows`` as one (B, W) tensor, padded with ``value`` on the right (or ``left``); with
    ``empty``, rows may all be empty (W = 0)."""
    if empty and not any(rows):
        return torch.zeros(len(rows), 0, dtype=dtype)
    return pad_sequence([torch.tensor(r, dtype=dtype) for r in rows], batch_first=True,
                        padding_value=value, padding_side="left" if left else "right")
