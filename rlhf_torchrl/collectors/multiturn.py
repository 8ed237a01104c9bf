"""Multi-turn episodes with tools: the policy answers, its tool calls run, their results come back
as a tool message, and it answers again, until it answers without a call, a tool says stop, or
the episode reaches its turn or token budget.

The first turn is the single-response path unchanged (TorchRL's ``ChatEnv`` and ``LLMCollector``
through :class:`~rlhf_torchrl.collectors.RolloutCollector`: prompts, groups, per-row streams);
:class:`MultiTurnCollector` then runs the later turns of the rows still going, batched, with the
same sampler. A row's episode is one token sequence::

    prompt | turn 1 | observation 1 | turn 2 | ... | turn k
             policy   environment     policy         policy

``("masks", "response")`` is True on the policy's tokens (PPO's loss, the KL, the entropy and GAE
run over them alone), ``("masks", "observation")`` on the environment's: the tool message and the
next assistant header, as the tokenizer's chat template renders them. The model attends to both.
Every policy token keeps the log-prob (and value) recorded when it was sampled, so the on-policy
check and PPO's first ratio hold across turns. A tool's reward
(:class:`~rlhf_torchrl.envs.tools.ToolResult`) goes to ``"turn_reward"`` at the last token of the turn
that called it; the verifier scores the episode at its end, as a single response is scored, from
the policy's own turns (``("text", "response")``: a tool's output never passes for the policy's
answer); ``("text", "episode")`` is the whole transcript, tool messages included.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator, Mapping

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict
from torch.nn.utils.rnn import pad_sequence

from rlhf_torchrl import functional as F
from rlhf_torchrl import keys as K
from rlhf_torchrl.data.rollout import END_REASONS
from rlhf_torchrl.envs.tools import ToolCall, parse_tool_calls, run_tool
from rlhf_torchrl.errors import ConfigError

_SENTINEL = "\ue000"  # a private-use character: where the assistant's text sits in a rendering


#: an added token shaped like markup (``<tool_call>``, ``</think>``, ``[INST]``): a control token of
#: the chat format even where the tokenizer does not mark it special (Qwen's tool-call tags)
_MARKUP = re.compile(r"<[^<>\s]+>|\[[^\[\]\s]+\]")
#: the tool message's text where the template's own text would join the tool's into a control token
WITHHELD = "(the tool's output was withheld: it would have read as the chat format's control tokens)"


def control_tokens(tokenizer) -> list[str]:
    """The strings ``tokenizer`` reads as one control token, longest first: its special tokens
    (those it names and every added token marked special) and the markup-shaped added tokens it
    matches whole though unmarked (Qwen's ``<tool_call>``); an added token of plain text (a run of
    spaces, a word) is not one.

    Args:
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer.
    """
    found = set(tokenizer.all_special_tokens)
    for added in tokenizer.added_tokens_decoder.values():
        if added.special or _MARKUP.fullmatch(added.content):
            found.add(added.content)
    return sorted((t for t in found if t), key=len, reverse=True)


def strip_control_tokens(text: str, controls: list[str]) -> str:
    """``text`` without any of the strings in ``controls``, removed to a fixed point: removing one
    can join its neighbours into another (``"<|im_" + "<|im_end|>" + "end|>"`` is a real
    ``<|im_end|>`` after one pass), so the passes repeat until one changes nothing. Each pass that
    changes the text shortens it, so the passes end.

    Args:
        text: a tool's output.
        controls: the control tokens' strings (:func:`control_tokens`).
    """
    while True:
        before = text
        for token in controls:
            text = text.replace(token, "")
        if text == before:
            return text


def observation_tokens(tokenizer, conversation: list[dict], tool_text: str,
                       stop_text: str, controls: list[str] | None = None) -> list[int]:
    """The tokens the environment writes after an assistant turn that ended with ``stop_text``:
    the rest of the turn's closing, the tool message with ``tool_text``, and the next assistant
    header, as the tokenizer's chat template renders them after ``conversation`` (which ends with
    that assistant turn).

    A tool's output must not open or close turns: its control-token strings are removed to a fixed
    point (:func:`strip_control_tokens`), and the control tokens of the result must be the
    template's own (those of the same message with ``"."`` for the tool's text). Where they are not
    (the template's text around the tool's joins it into one, or the tokenizer's normalizer makes
    one), the tool's text is :data:`WITHHELD`.

    Args:
        tokenizer (transformers.PreTrainedTokenizerBase): renders with its chat template.
        conversation: the episode so far, ending with the assistant turn.
        tool_text: the tools' output.
        stop_text: the text of the stop token the turn ended with.
        controls: :func:`control_tokens` of ``tokenizer`` (None: found here).
    """
    controls = control_tokens(tokenizer) if controls is None else controls
    # an unknown character's token is text, not structure
    control_ids = set(tokenizer.convert_tokens_to_ids(controls)) - {tokenizer.unk_token_id}

    def tail_ids(text: str) -> list[int]:
        rendered = tokenizer.apply_chat_template(
            [*conversation[:-1], {"role": "assistant", "content": _SENTINEL},
             {"role": "tool", "content": text}], tokenize=False, add_generation_prompt=True)
        tail = rendered[rendered.rindex(_SENTINEL) + len(_SENTINEL):]
        if stop_text and tail.startswith(stop_text):  # the policy wrote the turn's end token itself
            tail = tail[len(stop_text):]
        return tokenizer(tail, add_special_tokens=False)["input_ids"]

    ids = tail_ids(strip_control_tokens(tool_text, controls))
    template_own = [i for i in tail_ids(".") if i in control_ids]
    if [i for i in ids if i in control_ids] != template_own:
        ids = tail_ids(WITHHELD)
    return ids


class MultiTurnCollector:
    """Rollouts of episodes of up to ``max_turns`` assistant turns with ``tools``.

    Wraps a :class:`~rlhf_torchrl.collectors.RolloutCollector` (the first turn) and its
    generation policy (``make_generation_policy``, or the vLLM one: ``generate_tokens`` samples the
    later turns). After each turn, every row whose turn ended with a stop token has its tool calls
    (:func:`~rlhf_torchrl.envs.tools.parse_tool_calls`) run (:func:`~rlhf_torchrl.envs.tools.run_tool`:
    errors and timeouts become the tool's message); a row goes on if it made a call, no tool said
    stop, and the next turn fits: at most ``max_new_tokens`` per turn and ``max_tokens`` response
    tokens (policy and observation) in all, each row's own. The rows going on are sampled
    together; row ``i`` of batch ``k``'s turn ``t`` from its own stream
    (``row_stream_seeds(seed, k, row, turn=t)``) and cut at its own budget, so its episode does
    not depend on the rows beside it and a run stays world-size invariant.

    Adds to each rollout (besides the layout above): ``("episode", "turns")``,
    ``("episode", "tool_calls")``, ``("episode", "tool_errors")`` (B,) int64, and
    ``("episode", "end")`` (B,) int64, an index into :data:`~rlhf_torchrl.data.rollout.END_REASONS`.

    Args:
        collector (rlhf_torchrl.collectors.RolloutCollector): samples the first turn.
        policy (torch.nn.Module): its generation policy, which samples the later turns.
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer (chat template,
            tool messages).
        tools: tool name to function (:func:`~rlhf_torchrl.envs.tools.load_tools`).
        max_turns: assistant turns per episode, at most.
        max_new_tokens: a turn's budget, in tokens.
        max_tokens: an episode's budget of response tokens (policy and observation) in all (None:
            none).
        tool_timeout: seconds a tool call may run.
    """

    def __init__(self, collector, policy, *, tokenizer, tools: Mapping[str, Callable],
                 max_turns: int, max_new_tokens: int, max_tokens: int | None = None,
                 tool_timeout: float = 10.0):
        if max_turns < 1:
            raise ConfigError(f"max_turns={max_turns} (the recipe's env.max_turns): an episode "
                              "has at least one turn.")
        self.collector, self.policy, self.tokenizer = collector, policy, tokenizer
        self.tools, self.max_turns, self.tool_timeout = dict(tools), max_turns, tool_timeout
        self.max_new_tokens, self.max_tokens = max_new_tokens, max_tokens
        self.stop_token_ids = list(collector.stop_token_ids)
        self.value_recorder = getattr(policy, "value_recorder", None)
        self.controls = control_tokens(tokenizer)  # what a tool's output may not write

    @property
    def sampler(self):
        return self.collector.sampler

    def __iter__(self) -> Iterator[TensorDict]:
        for k, rollout in enumerate(self.collector):
            yield self.run_turns(rollout, self.collector.start_batch + k)

    def shutdown(self) -> None:
        self.collector.shutdown()

    # ---- one batch ------------------------------------------------------------------------------
    def run_turns(self, rollout: TensorDict, batch: int) -> TensorDict:
        """Continue the episodes whose first turn is ``rollout`` (batch index ``batch``).

        Args:
            rollout: the first turns, from the wrapped collector.
            batch: the batch's index (the turns' random streams).
        """
        if K.PROMPT_MESSAGES not in rollout.keys(True):
            raise ConfigError("Multi-turn episodes need the prompt conversation in the rollout "
                              "(('messages', 'prompt'): make_generation_env writes it).")
        conversations = rollout.get(K.PROMPT_MESSAGES).tolist()
        rows = [_Episode(rollout, i, conversations[i]) for i in range(rollout.shape[0])]
        for turn in range(1, self.max_turns + 1):
            going = [row for row in rows if self._act(row, turn)]
            if not going:
                break
            self._sample_turn(going, rollout, batch, turn)
        return self._to_rollout(rows, rollout)

    def _act(self, row: _Episode, turn: int) -> bool:
        """Run the calls of ``row``'s last turn; whether it goes on to another turn."""
        if row.end is not None:
            return False
        if not row.stopped:  # cut mid-turn: no tool runs on half a call
            spent = self.max_tokens is not None and len(row.tokens) >= self.max_tokens
            row.end = "max_tokens" if spent else "length"  # the episode's budget, or the turn's
            return False
        text = self.tokenizer.decode(row.last_turn_tokens(), skip_special_tokens=True)
        row.conversation.append({"role": "assistant", "content": text})
        calls: list[ToolCall] = parse_tool_calls(text)
        if not calls:
            row.end = "answer"
            return False
        results = [run_tool(self.tools, call, timeout=self.tool_timeout) for call in calls]
        row.tool_calls += len(calls)
        row.tool_errors += sum(not r.ok for r in results)
        row.turn_reward[row.last_policy_index()] += sum(r.reward or 0.0 for r in results)
        if any(r.stop for r in results):
            row.end = "tool_stop"
            return False
        if turn == self.max_turns:
            row.end = "max_turns"
            return False
        # the conversation keeps the text the policy read: no control tokens (observation_tokens)
        content = strip_control_tokens("\n".join(r.content for r in results), self.controls)
        observed = observation_tokens(self.tokenizer, row.conversation, content,
                                      self.tokenizer.decode([row.tokens[-1]]), self.controls)
        if self.max_tokens is not None and len(row.tokens) + len(observed) >= self.max_tokens:
            row.end = "max_tokens"
            return False
        row.conversation.append({"role": "tool", "content": content})
        row.append(observed, policy=False)
        return True

    def _sample_turn(self, going: list[_Episode], rollout: TensorDict, batch: int, turn: int) -> None:
        """The next turn of the rows in ``going``, sampled in one batch.

        Each row has its own budget: ``max_new_tokens``, or less where the episode's
        ``max_tokens`` is nearly spent. The batch runs for the largest and each row is cut to its
        own, so a row's turn (drawn from its own stream) does not depend on the rows beside it."""
        from rlhf_torchrl.collectors.sampling import row_stream_seeds

        pad = self.tokenizer.pad_token_id
        sequences = [torch.tensor(row.prompt + row.tokens) for row in going]
        input_ids = pad_sequence(sequences, batch_first=True, padding_value=pad, padding_side="left")
        attention = pad_sequence([torch.ones_like(s) for s in sequences], batch_first=True,
                                 padding_side="left")
        budgets = [self.max_new_tokens if self.max_tokens is None
                   else min(self.max_new_tokens, self.max_tokens - len(row.tokens))
                   for row in going]
        collector = self.collector
        if collector.seed is not None:
            global_rows = [collector.row_offset + row.index for row in going]
            self.sampler.set_streams(row_stream_seeds(collector.seed, batch, global_rows, turn=turn))
        new = self.policy.generate_tokens(input_ids, attention, max(max(budgets), 1))
        log_probs, entropies = self.sampler.pop() if collector.records else (None, None)
        values = self.value_recorder.pop() if self.value_recorder is not None else None
        # (B, T) right-padded, cut after each row's first stop token
        new, mask, stopped = F.truncate_after_stop(new, self.stop_token_ids, pad)
        for j, row in enumerate(going):
            n, stop = int(mask[j].sum()), bool(stopped[j])  # up to and with the stop token
            if n > budgets[j]:  # past the row's own budget: cut there, before any stop token
                n, stop = budgets[j], False
            row.append(new[j, :n].tolist(), policy=True,
                       log_probs=None if log_probs is None else log_probs[j, :n].tolist(),
                       entropies=None if entropies is None else entropies[j, :n].tolist(),
                       values=None if values is None else values[j, :n].tolist())
            row.stopped = stop
            row.turns += 1

    def _to_rollout(self, rows: list[_Episode], rollout: TensorDict) -> TensorDict:
        """``rollout`` with its response-width entries rebuilt from the episodes."""
        def padded(per_row, value=0, dtype=None):  # right-padded (B, R)
            return pad_sequence([torch.tensor(r, dtype=dtype) for r in per_row], batch_first=True,
                                padding_value=value)

        tokens = padded([row.tokens for row in rows], self.tokenizer.pad_token_id, torch.long)
        policy = padded([row.policy for row in rows], False, torch.bool)
        observed = padded([[not p for p in row.policy] for row in rows], False, torch.bool)
        turn_reward = padded([row.turn_reward for row in rows], dtype=torch.float32)
        recorded = {key: padded([row.recorded[key] for row in rows], dtype=torch.float32)
                    for key in (K.LOG_PROB, K.ENTROPY, K.VALUE) if key in rollout.keys(True)}
        out = rollout.exclude(*(k for k, v in rollout.items(True, True)
                                if isinstance(v, torch.Tensor) and v.ndim >= 2
                                and k not in K.PROMPT_WIDTH))
        out.update({K.RESPONSE_TOKENS: tokens, K.RESPONSE_MASK: policy,
                    K.OBSERVATION_MASK: observed, K.TURN_REWARD: turn_reward,
                    K.HAS_STOP: torch.tensor([row.stopped for row in rows]),
                    K.TURNS: torch.tensor([row.turns for row in rows]),
                    K.TOOL_CALLS: torch.tensor([row.tool_calls for row in rows]),
                    K.TOOL_ERRORS: torch.tensor([row.tool_errors for row in rows]),
                    K.EPISODE_END: torch.tensor([END_REASONS.index(row.end or "length")
                                                 for row in rows])})
        for key, values in recorded.items():
            out.set(key, values.unsqueeze(-1) if key == K.VALUE else values)
        # what the rewards read: the policy's own turns, so that a tool's output (a calculator's
        # "5" before a turn cut at its budget) never passes for the policy's answer; the whole
        # transcript, tool messages included, for reading
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=True)
        own = ["\n".join(decode(turn) for turn in row.policy_turns()) for row in rows]
        whole = [decode(row.tokens) for row in rows]
        out.set(K.RESPONSE_TEXT, NonTensorStack(*(NonTensorData(t) for t in own)))
        out.set(K.EPISODE_TEXT, NonTensorStack(*(NonTensorData(t) for t in whole)))
        return out


class _Episode:
    """One row's episode so far: the prompt's tokens, then every response-width token with its
    origin (policy or environment) and what was recorded when the policy sampled it."""

    def __init__(self, rollout: TensorDict, i: int, conversation: list[dict]):
        self.index = i
        self.prompt = rollout.get(K.PROMPT_TOKENS)[i][rollout.get(K.PROMPT_MASK)[i]].tolist()
        mask = rollout.get(K.RESPONSE_MASK)[i]
        self.tokens = rollout.get(K.RESPONSE_TOKENS)[i][mask].tolist()
        self.policy = [True] * len(self.tokens)
        self.turn_reward = [0.0] * len(self.tokens)
        keys = rollout.keys(True)
        self.recorded = {}
        for key in (K.LOG_PROB, K.ENTROPY, K.VALUE):
            if key in keys:
                values = rollout.get(key)[i]
                self.recorded[key] = (values.squeeze(-1) if key == K.VALUE else values)[mask].tolist()
        self.conversation = [dict(m) for m in conversation]
        self.stopped = bool(rollout.get(K.HAS_STOP)[i])
        self.turns, self.tool_calls, self.tool_errors = 1, 0, 0
        self.end: str | None = None
        self._turn_start = 0

    def last_turn_tokens(self) -> list[int]:
        return self.tokens[self._turn_start:]

    def policy_turns(self) -> list[list[int]]:
        """The policy's tokens, turn by turn (the runs between observations)."""
        turns: list[list[int]] = []
        for i, (token, own) in enumerate(zip(self.tokens, self.policy)):
            if own:
                if i == 0 or not self.policy[i - 1]:
                    turns.append([])
                turns[-1].append(token)
        return turns

    def last_policy_index(self) -> int:
        return len(self.tokens) - 1

    def append(self, tokens: list[int], *, policy: bool, log_probs=None, entropies=None,
               values=None) -> None:
        if policy:
            self._turn_start = len(self.tokens)
        self.tokens += tokens
        self.policy += [policy] * len(tokens)
        self.turn_reward += [0.0] * len(tokens)
        given = {K.LOG_PROB: log_probs, K.ENTROPY: entropies, K.VALUE: values}
        for key, values_ in self.recorded.items():
            values_ += given[key] if policy and given[key] is not None else [0.0] * len(tokens)
