"""The prompt environment: TorchRL's ``ChatEnv`` serving this process's share of each batch of
prompts (``ChatEnv.from_dataloader(input_mode="text")``: the chat template applied by the env;
``StepCounter(max_steps=1)``: one response an episode, so every batch starts from fresh prompts).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict
from torch.utils.data import DataLoader

from rlhf_torchrl.data.prompt_sets import MixtureBatchSampler, PromptMixture, PromptSet
from rlhf_torchrl.data.prompts import Prompt, to_prompt
from rlhf_torchrl.errors import ConfigError


def make_generation_env(
    prompts: Sequence[Prompt | str],
    tokenizer,
    *,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    system_prompt: str | None = None,
    rank: int = 0,
    world_size: int = 1,
    start_batch: int = 0,
    samples_per_prompt: int = 1,
):
    """A TorchRL ``ChatEnv`` that yields prompts from global batches of ``batch_size``, cycling forever.

    The env renders each conversation with ``tokenizer``'s chat template (a pass-through template
    for base models, see :func:`~rlhf_torchrl.modules.load_tokenizer`); the conversation and the
    fields ride along in every batch (``"query"`` and ``"fields"``), so that :func:`to_rollout`
    hands them to the reward functions.

    Data parallel: every process shuffles the same global batches (``seed``) and process ``rank`` of
    ``world_size`` gets rows ``rank * b ... (rank + 1) * b - 1`` of each, ``b = batch_size /
    world_size`` (its env's batch size).

    A :class:`~rlhf_torchrl.data.prompt_sets.PromptSet` is read lazily: a prompt is made (and
    length-checked) when a batch serves it. A :class:`~rlhf_torchrl.data.prompt_sets.PromptMixture`
    is served in proportion to its weights (:class:`~rlhf_torchrl.data.prompt_sets.MixtureBatchSampler`,
    always shuffled).

    Args:
        prompts: :class:`~rlhf_torchrl.data.prompts.Prompt` rows (a conversation and dataset fields),
            plain user messages, or a :class:`~rlhf_torchrl.data.prompt_sets.PromptSet` or
            :class:`~rlhf_torchrl.data.prompt_sets.PromptMixture`.
        tokenizer (transformers.PreTrainedTokenizerBase): renders the conversations with its chat
            template.
        batch_size: rows of a global batch (every process's together).
        shuffle: a new shuffled order every epoch (False: the prompts in order).
        seed: the shuffle's seed, the same on every process.
        system_prompt: put first in conversations that have no system message (None: none).
        rank: this process's rank.
        world_size: the number of processes.
        start_batch: begin with global batch ``start_batch`` of that order (a resumed run), the
            earlier ones skipped without being served.
        samples_per_prompt: ``N``: a global batch holds ``batch_size / N`` prompts, each served
            ``N`` times in a row (a group of responses to one prompt); a group is never split over
            processes, so ``batch_size / N`` must be a multiple of ``world_size``.
    """
    from torchrl.envs import InitTracker, StepCounter
    from torchrl.envs.llm import ChatEnv

    check_group_sizes(batch_size, samples_per_prompt, world_size)
    n_prompts = batch_size // samples_per_prompt
    if len(prompts) < n_prompts:
        raise ConfigError(
            f"The prompt set has {len(prompts)} prompts, fewer than one batch "
            f"({n_prompts} prompts): add prompts or lower the batch size."
        )
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is not one of the {world_size} processes.")
    if isinstance(prompts, (PromptSet, PromptMixture)):  # each prompt made when a batch asks
        rows = _ServedPrompts(prompts, system_prompt)
    else:
        rows = [to_prompt(p, system_prompt) for p in prompts]
    local = batch_size // world_size
    if isinstance(prompts, PromptMixture):
        batches = MixtureBatchSampler(prompts.sizes, prompts.weights, n_prompts, rank=rank,
                                      world_size=world_size, seed=seed, skip=start_batch,
                                      repeats=samples_per_prompt)
    else:
        batches = ShardedBatchSampler(len(rows), n_prompts, rank=rank, world_size=world_size,
                                      shuffle=shuffle, seed=seed, skip=start_batch,
                                      repeats=samples_per_prompt)
    loader = DataLoader(rows, batch_sampler=batches, collate_fn=_collate_prompts)
    env = ChatEnv.from_dataloader(
        loader,
        batch_size=(local,),
        tokenizer=tokenizer,
        input_mode="text",
        data_key="query",
        # TorchRL's History picks a template by model *name* (or plain ChatML) unless told: give it
        # the tokenizer's own, the one the model was trained with
        template_kwargs={"chat_template": tokenizer.chat_template},
    )
    # InitTracker: the transform TransformersWrapper expects on the env (LLMCollector checks it)
    return env.append_transform(StepCounter(max_steps=1)).append_transform(InitTracker())


def check_group_sizes(batch_size: int, samples_per_prompt: int, world_size: int = 1, *,
                      names: tuple[str, str] = ("batch_size", "samples_per_prompt")) -> None:
    """A batch of ``batch_size`` responses holds whole groups of ``samples_per_prompt``, and its
    groups split evenly over ``world_size`` processes (a group is never split).

    Args:
        batch_size: rows of a global batch.
        samples_per_prompt: responses per prompt.
        world_size: the number of processes.
        names: what the caller calls the two sizes, for the error (the recipe:
            ``ppo.batch_size``, ``generation.samples_per_prompt``).
    """
    size, group = (f"{names[0]}={batch_size}", f"{names[1]}={samples_per_prompt}")
    if samples_per_prompt < 1 or batch_size % samples_per_prompt:
        raise ConfigError(f"{size} responses do not make whole groups of {group}: use a "
                          "multiple of it.")
    if (batch_size // samples_per_prompt) % world_size:
        raise ConfigError(
            f"The {batch_size // samples_per_prompt} prompts of a batch ({size} / {group}) do not "
            f"split over {world_size} processes (a group of responses stays on one process): make "
            "the number of prompts a multiple of the number of processes.")


class ShardedBatchSampler(torch.utils.data.Sampler):
    """Global batches of ``batch_size`` row indices (shuffled with ``seed``, a new order every epoch,
    incomplete last batch dropped); yields this ``rank``'s contiguous ``batch_size / world_size``
    slice of each, every index ``repeats`` times in a row (a group of responses to one prompt).
    Every process draws the same global order. The first ``skip`` global batches (over epochs)
    are drawn but not served: a resumed run continues the order where it stopped.

    Args:
        n: the number of rows (prompts) to draw from.
        batch_size: rows of a global batch (every process's together).
        rank: this process's rank.
        world_size: the number of processes.
        shuffle: shuffle with ``seed`` (False: in order).
        seed: the shuffle's seed.
        skip: global batches drawn but not served (a resumed run).
        repeats: times each index is yielded in a row (``samples_per_prompt``).
    """

    def __init__(self, n: int, batch_size: int, *, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True, seed: int = 0, skip: int = 0, repeats: int = 1):
        self.n, self.batch_size, self.shuffle, self.repeats = n, batch_size, shuffle, repeats
        self.local = batch_size // world_size
        self.start = rank * self.local
        self.generator = torch.Generator().manual_seed(seed)
        self._skip = skip

    def __len__(self) -> int:
        return self.n // self.batch_size

    def __iter__(self):
        order = torch.randperm(self.n, generator=self.generator) if self.shuffle else torch.arange(self.n)
        for i in range(len(self)):
            if self._skip:
                self._skip -= 1
                continue
            batch = order[i * self.batch_size : (i + 1) * self.batch_size]
            yield batch[self.start : self.start + self.local].repeat_interleave(self.repeats).tolist()


class _ServedPrompts(torch.utils.data.Dataset):
    """A prompt set as the loader reads it: prompt ``i`` made, given ``system_prompt`` when it has
    no system message of its own, only when a batch asks for it."""

    def __init__(self, prompts: Sequence, system_prompt: str | None):
        self.prompts, self.system_prompt = prompts, system_prompt

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> Prompt:
        return to_prompt(self.prompts[i], self.system_prompt)


def _collate_prompts(rows: list[Prompt]) -> TensorDict:
    """A batch as a TensorDict of non-tensor entries: TorchRL's loader would turn a dict of lists of
    dicts into a lazy stack that cannot be batched. The conversations and fields are copies: the
    rollouts hand them to reward functions, and nothing downstream copies them again
    (:class:`_OneTurnCollector`)."""
    return TensorDict(
        {"query": NonTensorStack(*(NonTensorData(copy.deepcopy(r.messages)) for r in rows)),
         "fields": NonTensorStack(*(NonTensorData(copy.deepcopy(r.fields)) for r in rows))},
        batch_size=[len(rows)],
    )
