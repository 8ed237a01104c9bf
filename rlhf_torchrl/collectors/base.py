"""Generation as a TorchRL environment and collector that emit dense rollout TensorDicts.

TorchRL pieces: ``ChatEnv.from_dataloader(input_mode="text")`` serves batches of prompts (the chat
template is applied by the env), ``StepCounter(max_steps=1)`` ends each episode after one response
so every batch starts from fresh prompts, ``TransformersWrapper(generate=True)`` samples, and
``LLMCollector`` runs them. :class:`RolloutCollector` turns each ragged, lazily-stacked batch into
the dense layout of :mod:`rlhf_torchrl.keys` and truncates responses after the first stop token.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
from collections.abc import Iterator, Sequence

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase, lazy_stack
from tensordict.base import _is_leaf_nontensor
from torch.utils.data import DataLoader
from torchrl.collectors.llm import LLMCollector
from torchrl.modules.llm import TransformersWrapper

from .. import functional as F
from .. import keys as K
from ..data import Prompt, prompt_token_ids, to_prompt
from ..errors import ConfigError
from ..prompt_sets import MixtureBatchSampler, PromptMixture, PromptSet


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

    A :class:`~rlhf_torchrl.prompt_sets.PromptSet` is read lazily: a prompt is made (and
    length-checked) when a batch serves it. A :class:`~rlhf_torchrl.prompt_sets.PromptMixture`
    is served in proportion to its weights (:class:`~rlhf_torchrl.prompt_sets.MixtureBatchSampler`,
    always shuffled).

    Args:
        prompts: :class:`~rlhf_torchrl.data.Prompt` rows (a conversation and dataset fields),
            plain user messages, or a :class:`~rlhf_torchrl.prompt_sets.PromptSet` or
            :class:`~rlhf_torchrl.prompt_sets.PromptMixture`.
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


def make_generation_policy(
    model,
    tokenizer,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_token_ids: Sequence[int] | None = None,
    record_log_probs: bool = False,
    record_entropy: bool = False,
    device: torch.device | str | None = None,
    autocast_dtype: torch.dtype | None = None,
    samples_per_prompt: int = 1,
    value_head: torch.nn.Module | None = None,
):
    """TorchRL's ``TransformersWrapper`` set up to sample responses on-policy.

    Tokens are drawn by :class:`~rlhf_torchrl.sampling.InverseCDFSampler` (exact, and on CPU
    several times faster than ``generate``'s multinomial). ``top_k=0`` and ``top_p=1.0`` sample
    from the full temperature-scaled distribution, the one the PPO log-probs are computed under.
    Nothing else touches the logits: ``generate`` gets these settings and transformers' neutral
    defaults (:func:`~rlhf_torchrl.sampling.sampling_generation_config`), never the checkpoint's
    own ``generation_config`` (a warning names what that leaves out). The rendered prompt is tokenised
    without adding special tokens (the chat template already wrote them).

    With ``record_log_probs`` (and ``record_entropy``) the sampler keeps the sampled tokens'
    log-probs (and exact entropies), which :class:`RolloutCollector` writes to each rollout: no
    policy forward is needed to get PPO's old log-probs. TorchRL's own log-probs are never
    requested: they are wrong for PPO (see :mod:`rlhf_torchrl.modules.actor_critic`).

    Args:
        model (transformers.PreTrainedModel): the policy's causal LM (the trained model itself).
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer.
        max_new_tokens: the response budget, in tokens.
        temperature: the sampling temperature.
        top_k: keep the ``k`` likeliest tokens (0: all).
        top_p: nucleus sampling's mass (1.0: all).
        stop_token_ids: the ids that end a response (None: the tokenizer's EOS).
        record_log_probs: keep the sampled tokens' log-probs.
        record_entropy: keep their exact entropies too.
        device: where prompts are tokenised (None: the model's device).
        autocast_dtype: run ``generate`` under ``torch.autocast`` with this dtype, the LM head in
            fp32 (:func:`~rlhf_torchrl.modules.models.lm_head_in_fp32`): the sampler reads fp32
            logits. None: no autocast.
        samples_per_prompt: ``N``: batches come in groups of ``N`` consecutive rows with one
            prompt (:func:`make_generation_env`); each group's prompt is prefilled once and its KV
            cache repeated for the ``N`` rows (:func:`generate_in_groups`), the same tokens and
            scores as ``N`` prefills.
        value_head: the head of a critic on ``model``'s own trunk (``make_critic(init="shared")``):
            a :class:`~rlhf_torchrl.sampling.ValueRecorder` then reads each response token's value
            off the sampling forwards, and :class:`RolloutCollector` writes them as
            ``"state_value"`` (the old values need no trunk forward of their own). None: no values.
    """
    from transformers import LogitsProcessorList

    from ..modules.lora import trunk
    from ..modules.models import lm_head_in_fp32
    from ..runtime import module_device
    from ..sampling import (
        InverseCDFSampler,
        ValueRecorder,
        sampling_generation_config,
        warn_ignored_generation_settings,
    )

    stop_token_ids = list(stop_token_ids or [tokenizer.eos_token_id])
    if autocast_dtype is not None:  # the trunk in bf16/fp16, the logits the sampler reads in fp32
        lm_head_in_fp32(model)
    sampler = InverseCDFSampler(temperature, top_k, top_p, record=record_log_probs,
                                record_entropy=record_entropy)
    warn_ignored_generation_settings(model, temperature)
    policy = _OnPolicyTransformersWrapper(
        model,
        tokenizer=tokenizer,
        input_mode="text",
        generate=True,
        return_log_probs=False,
        pad_output=True,
        # the chat template already wrote BOS (Llama 3, Gemma): adding specials would double it
        tokenizer_kwargs={"add_special_tokens": False},
        device=torch.device(device) if device is not None else module_device(model),
        generate_kwargs={
            "max_new_tokens": max_new_tokens,
            "do_sample": False,  # greedy over the sampler's one-hot scores = the sampler's draw
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": stop_token_ids,
        },
    )
    policy.generation_config = sampling_generation_config(model)
    policy.autocast_dtype = autocast_dtype
    policy.samples_per_prompt = samples_per_prompt
    policy.value_recorder = ValueRecorder(trunk(model), value_head) if value_head is not None else None
    # TransformersWrapper drops generate_kwargs it does not know, logits_processor among them
    # (tests/test_torchrl_upstream.py): set it on the built wrapper
    policy.generate_kwargs["logits_processor"] = LogitsProcessorList([sampler])
    return policy


class _OnPolicyTransformersWrapper(TransformersWrapper):
    """``TransformersWrapper`` whose ``generate`` runs under ``self.generation_config``.

    transformers fills every generation setting it is not given from ``model.generation_config``,
    and a checkpoint's repetition penalty or suppressed tokens would bend the distribution the
    tokens are drawn from (off-policy). The model's own config is swapped out only for the call,
    which runs under ``torch.autocast`` when ``autocast_dtype`` is set. The ``generate`` call
    records values (``value_recorder``) and prefills each group's prompt once
    (``samples_per_prompt``) where those are set.
    """

    generation_config = None
    autocast_dtype = None
    samples_per_prompt = 1  # > 1: the prompt of each group of rows is prefilled once
    value_recorder = None  # a ValueRecorder: values read off the sampling forwards

    def forward(self, *args, **kwargs):
        with self._sampling(grouped=True):
            return super().forward(*args, **kwargs)

    @contextlib.contextmanager
    def _sampling(self, *, grouped: bool):
        """The model's own generation config swapped out, ``self.model.generate`` shadowed by one
        that records values (around the generate itself) and, with ``grouped``, prefills each
        group once (before it), all under autocast."""
        from ..modules.lora import hf_model
        from ..runtime import autocast

        # PEFT copies its config onto the base model in generate: swap (and restore) that one
        model = hf_model(self.model)
        own = getattr(model, "generation_config", None)
        if self.generation_config is not None:
            model.generation_config = self.generation_config
        generate = self.model.generate
        if self.value_recorder is not None:
            generate = self.value_recorder.wrap(generate)
        # FSDP2 (synced_gpus): every process must run the same forwards; no per-batch choice there
        grouped = (grouped and self.samples_per_prompt > 1
                   and not self.generate_kwargs.get("synced_gpus"))
        if grouped:
            generate = functools.partial(generate_in_groups, self.model, generate,
                                         self.samples_per_prompt)
        shadowed = grouped or self.value_recorder is not None
        if shadowed:  # TorchRL's wrapper calls self.model.generate
            self.model.generate = generate
        try:
            with autocast(self._device, self.autocast_dtype):
                yield generate
        finally:
            if self.generation_config is not None:
                model.generation_config = own
            if shadowed:
                del self.model.generate

    def generate_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        max_new_tokens: int) -> torch.Tensor:
        """Sample continuations of left-padded token rows as :meth:`forward` samples responses
        (same sampler, stop tokens, recorded log-probs and values), each row on its own (no
        grouped prefill): the next turn of a multi-turn episode. Returns (B, T) new tokens,
        right-padded with the pad token."""
        kwargs = {**self.generate_kwargs, "max_new_tokens": max_new_tokens}
        groups = getattr(self.model, "samples_per_prompt", None)  # a vLLM engine's request size
        if groups is not None:
            self.model.samples_per_prompt = 1
        try:
            with self._sampling(grouped=False) as generate, torch.no_grad():
                out = generate(input_ids=input_ids.to(self._device),
                               attention_mask=attention_mask.to(self._device), **kwargs)
        finally:
            if groups is not None:
                self.model.samples_per_prompt = groups
        sequences = out["sequences"] if isinstance(out, dict) else getattr(out, "sequences", out)
        return sequences[:, input_ids.shape[1]:].cpu()


def generate_in_groups(model, generate, group: int, *, input_ids: torch.Tensor,
                       attention_mask: torch.Tensor, **kwargs):
    """``generate(input_ids, attention_mask, **kwargs)`` for a batch of groups of ``group``
    consecutive rows with the same (left-padded) prompt, prefilling each prompt once.

    The prompt without its last token runs once per group (the first row of each), its KV cache
    is repeated for every row of the group (``DynamicCache.batch_repeat_interleave``), and
    ``generate`` continues from that cache: it runs the last prompt token, then samples. Tokens and
    scores are those of a prefill per row (``tests/test_sampling.py``); on a 2-core CPU with
    SmolLM2, 8 prompts x 4 responses of 48 tokens, the prefill was ~21% of generation and one per
    group saves ~3/4 of it. A batch that is not made of such groups is generated as it is.

    Args:
        model (transformers.PreTrainedModel): the model whose forward prefills the prompts.
        generate (Callable): ``model.generate`` or a wrapper of it.
        group: rows per group (1: a prefill per row).
        input_ids: (B, P) left-padded prompt tokens.
        attention_mask: (B, P) their attention mask.
        **kwargs: passed to ``generate``.
    """
    from transformers import DynamicCache

    first, first_mask = input_ids[::group], attention_mask[::group]
    prefix_mask = first_mask[:, :-1]
    if (input_ids.shape[0] % group or input_ids.shape[1] < 2 or not bool(prefix_mask.any(-1).all())
            or not torch.equal(input_ids, first.repeat_interleave(group, 0))
            or not torch.equal(attention_mask, first_mask.repeat_interleave(group, 0))):
        return generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    cache = DynamicCache(config=getattr(model, "config", None))
    with torch.no_grad():
        model(input_ids=first[:, :-1], attention_mask=prefix_mask,
              position_ids=F.position_ids_from_mask(prefix_mask), past_key_values=cache,
              use_cache=True)
    cache.batch_repeat_interleave(group)
    return generate(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache,
                    **kwargs)


def sampler_of(policy):
    """What draws a generation policy's tokens and records their log-probs: the transformers
    backend's :class:`~rlhf_torchrl.sampling.InverseCDFSampler`, or the
    :class:`~rlhf_torchrl.collectors.vllm.VLLMGenerator` in the model's place; None otherwise.

    Args:
        policy (torch.nn.Module): a generation policy (:func:`make_generation_policy` or the vLLM
            one).
    """
    from ..sampling import InverseCDFSampler

    processors = getattr(policy, "generate_kwargs", {}).get("logits_processor") or []
    sampler = next((p for p in processors if isinstance(p, InverseCDFSampler)), None)
    model = getattr(policy, "model", None)
    if sampler is None and all(hasattr(model, a) for a in ("set_streams", "pop", "record")):
        sampler = model
    return sampler


def to_rollout(
    batch: TensorDictBase, *, pad_token_id: int, stop_token_ids: Sequence[int], tokenizer=None
) -> TensorDict:
    """Dense rollout from one ``LLMCollector`` batch of shape ``[B, 1]``.

    Keys written (see :mod:`rlhf_torchrl.keys`): prompt tokens/mask (B, P) left-padded, response
    tokens/mask (B, R) right-padded and truncated after the first stop token, ``has_stop_token``
    (B,), with ``tokenizer`` the decoded prompt and response text, and, when the env carries them
    (:func:`make_generation_env`), the prompt conversations and the dataset fields.

    Args:
        batch: one ``LLMCollector`` batch, shape ``[B, 1]``.
        pad_token_id: the pad id.
        stop_token_ids: the ids that end a response.
        tokenizer (transformers.PreTrainedTokenizerBase | None): decodes the text entries (None: no
            text).
    """
    batch = batch.reshape(-1)
    # dense already when the wrapper pads its outputs; padded here if the stack is ragged
    prompt = batch.get(K.PROMPT_TOKENS, as_padded_tensor=True, padding_side="left",
                       padding_value=pad_token_id)
    response = batch.get(K.RESPONSE_TOKENS, as_padded_tensor=True, padding_side="right",
                         padding_value=pad_token_id)
    full_mask = batch.get(("masks", "all_attention_mask"), as_padded_tensor=True,
                          padding_side="left", padding_value=0)
    keys = batch.keys()
    return build_rollout(
        prompt, full_mask[:, : prompt.shape[-1]].bool(), response,
        stop_token_ids=stop_token_ids, pad_token_id=pad_token_id, tokenizer=tokenizer,
        messages=batch.get("query").tolist() if "query" in keys else None,
        fields=batch.get("fields").tolist() if "fields" in keys else None,
    )


def build_rollout(
    prompt: torch.Tensor,
    prompt_mask: torch.Tensor,
    response: torch.Tensor,
    *,
    stop_token_ids: Sequence[int],
    pad_token_id: int,
    tokenizer=None,
    messages: list[list[dict]] | None = None,
    fields: list[dict] | None = None,
) -> TensorDict:
    """The rollout layout of :mod:`rlhf_torchrl.keys` from padded prompt and response tokens.

    Args:
        prompt: (B, P) prompt tokens, left-padded.
        prompt_mask: (B, P) their attention mask.
        response: (B, R) response tokens as generated, right-padded (cut here after the first of
            ``stop_token_ids``).
        stop_token_ids: the ids that end a response.
        pad_token_id: the pad id written after a stop token.
        tokenizer (transformers.PreTrainedTokenizerBase | None): decodes the prompt and response
            text (None: no text entries).
        messages: one conversation per row, to ``("messages", "prompt")`` (None: none).
        fields: one dict of dataset columns per row, to ``("data", <column>)`` (None: none).
    """
    response, response_mask, has_stop = F.truncate_after_stop(response, stop_token_ids, pad_token_id)
    # drop columns that are padding in every row (responses that all stopped early)
    width = int(response_mask.sum(-1).max().clamp_min(1))
    response, response_mask = response[:, :width], response_mask[:, :width]
    out = TensorDict(
        {
            K.PROMPT_TOKENS: prompt,
            K.PROMPT_MASK: prompt_mask,
            K.RESPONSE_TOKENS: response,
            K.RESPONSE_MASK: response_mask,
            K.HAS_STOP: has_stop,
            K.GROUP: torch.arange(prompt.shape[0]),  # one response per prompt (a collector of groups sets its own)
        },
        batch_size=[prompt.shape[0]],
    )
    if tokenizer is not None:
        out.set(K.PROMPT_TEXT, decode(tokenizer, prompt, prompt_mask))
        out.set(K.RESPONSE_TEXT, decode(tokenizer, response, response_mask, skip_special=True))
    if messages is not None:
        out.set(K.PROMPT_MESSAGES, NonTensorStack(*(NonTensorData(m) for m in messages)))
    if fields:
        for name in sorted({name for row in fields for name in row}):
            values = [row.get(name) for row in fields]
            out.set((K.DATA, name), NonTensorStack(*(NonTensorData(v) for v in values)))
    return out


def pad_rollout(rollout: TensorDictBase, prompt_width: int, response_width: int,
                pad_token_id: int) -> TensorDictBase:
    """``rollout`` with its prompt entries left-padded to ``prompt_width`` and its response-wide
    entries right-padded to ``response_width`` (pad token for tokens, False for masks, 0
    otherwise): the layout a collector of a wider batch would have produced. Non-tensor entries
    are kept.

    Args:
        rollout: a rollout in :func:`to_rollout`'s layout.
        prompt_width: the prompt width to pad to, ``>=`` the rollout's.
        response_width: the response width to pad to, ``>=`` the rollout's.
        pad_token_id: the pad id for token entries.
    """
    r_local = rollout.get(K.RESPONSE_MASK).shape[1]
    out = rollout.clone(False)
    for key, value in rollout.items(True, True):
        if not isinstance(value, torch.Tensor):
            continue
        fill = pad_token_id if key in (K.PROMPT_TOKENS, K.RESPONSE_TOKENS) else 0
        if key in K.PROMPT_WIDTH:
            out.set(key, _pad_dim1(value, prompt_width, fill, left=True))
        elif value.ndim >= 2 and value.shape[1] == r_local:
            out.set(key, _pad_dim1(value, response_width, fill, left=False))
    return out


def concat_rollouts(rollouts: Sequence[TensorDictBase], pad_token_id: int) -> TensorDict:
    """One rollout of all the rows of ``rollouts`` (in order), padded to the widest prompt and
    response; text and dataset fields included.

    Args:
        rollouts: rollouts in :func:`to_rollout`'s layout.
        pad_token_id: pads the narrower rollouts' tokens.
    """
    p_width = max(r.get(K.PROMPT_MASK).shape[1] for r in rollouts)
    r_width = max(r.get(K.RESPONSE_MASK).shape[1] for r in rollouts)
    padded = [pad_rollout(r, p_width, r_width, pad_token_id) for r in rollouts]
    out = TensorDict(batch_size=[sum(r.shape[0] for r in rollouts)])
    for key, value in padded[0].items(True, True, is_leaf=_is_leaf_nontensor):
        if isinstance(value, torch.Tensor):
            out.set(key, torch.cat([r.get(key) for r in padded]))
        else:
            rows = [v for r in padded for v in r.get(key).tolist()]
            out.set(key, NonTensorStack(*(NonTensorData(v) for v in rows)))
    return out


def _pad_dim1(value: torch.Tensor, width: int, fill, *, left: bool) -> torch.Tensor:
    missing = width - value.shape[1]
    if missing <= 0:
        return value
    pad = torch.full((value.shape[0], missing, *value.shape[2:]), fill, dtype=value.dtype,
                     device=value.device)
    return torch.cat([pad, value] if left else [value, pad], dim=1)


def probe_rollout(
    prompts: Sequence[Prompt | str],
    tokenizer,
    responses: Sequence[str],
    *,
    stop_token_ids: Sequence[int] | None = None,
    stopped: Sequence[bool] | None = None,
    with_log_probs: bool = False,
    with_values: bool = False,
    multi_turn: bool = False,
) -> TensorDict:
    """A rollout in :class:`RolloutCollector`'s layout, made without a model.

    One row per prompt, at most ``len(responses)``: row ``i`` pairs ``prompts[i]`` (rendered and
    tokenised as the env does) with ``responses[i]``. Used to call every reward on the real
    rollout layout before any model is loaded.

    Args:
        prompts: the prompts, as :func:`make_generation_env` takes them.
        tokenizer (transformers.PreTrainedTokenizerBase): renders and tokenises them.
        responses: made-up response texts.
        stop_token_ids: the ids that end a response (None: the tokenizer's EOS).
        stopped: whether each response ends with the first stop token (None: rows 0, 2, ...).
        with_log_probs: also hold the sampler's records (zeros), as a recording collector's
            rollouts do.
        with_values: also hold a value recorder's values (zeros).
        multi_turn: also hold the entries of a
            :class:`~rlhf_torchrl.collectors.MultiTurnCollector`'s episodes (one turn each, no
            tool called).
    """
    rows = [to_prompt(p) for p in prompts[: len(responses)]]
    responses = list(responses)[: len(rows)]
    stop_token_ids = list(stop_token_ids or [tokenizer.eos_token_id])
    stopped = [i % 2 == 0 for i in range(len(rows))] if stopped is None else stopped
    if any(not text and not s for text, s in zip(responses, stopped)):
        raise ValueError("An empty response must end with the stop token (stopped=True).")
    prompt = tokenizer.pad({"input_ids": [prompt_token_ids(tokenizer, r) for r in rows]},
                           padding_side="left", return_tensors="pt")
    response = tokenizer.pad({"input_ids": [
        tokenizer(text, add_special_tokens=False)["input_ids"] + ([stop_token_ids[0]] if s else [])
        for text, s in zip(responses, stopped)]}, padding_side="right", return_tensors="pt")
    rollout = build_rollout(prompt["input_ids"], prompt["attention_mask"].bool(),
                            response["input_ids"], stop_token_ids=stop_token_ids,
                            pad_token_id=tokenizer.pad_token_id, tokenizer=tokenizer,
                            messages=[r.messages for r in rows], fields=[r.fields for r in rows])
    if with_log_probs:
        zeros = torch.zeros(rollout.get(K.RESPONSE_MASK).shape)
        rollout.update({K.LOG_PROB: zeros, K.ENTROPY: zeros.clone()})
    if with_values:
        rollout.set(K.VALUE, torch.zeros(*rollout.get(K.RESPONSE_MASK).shape, 1))
    if multi_turn:
        from .multiturn import END_REASONS

        mask = rollout.get(K.RESPONSE_MASK)
        n = mask.shape[0]
        rollout.update({K.OBSERVATION_MASK: torch.zeros_like(mask), K.TURN_REWARD: torch.zeros(mask.shape),
                        K.TURNS: torch.ones(n, dtype=torch.long),
                        K.TOOL_CALLS: torch.zeros(n, dtype=torch.long),
                        K.TOOL_ERRORS: torch.zeros(n, dtype=torch.long),
                        K.EPISODE_END: torch.full((n,), END_REASONS.index("answer"))})
    return rollout


def decode(tokenizer, tokens: torch.Tensor, mask: torch.Tensor, skip_special: bool = False) -> list[str]:
    """Decode the masked tokens of each row.

    Args:
        tokenizer (transformers.PreTrainedTokenizerBase): the tokenizer.
        tokens: (B, T) token ids.
        mask: (B, T) the tokens to decode.
        skip_special: leave special tokens out of the text.
    """
    return [
        tokenizer.decode(row[m].tolist(), skip_special_tokens=skip_special)
        for row, m in zip(tokens, mask.bool())
    ]


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
    from torchrl.envs import Compose, InitTracker, StepCounter, TransformedEnv
    from torchrl.envs.llm import ChatEnv
    from torchrl.envs.llm.transforms import DataLoadingPrimer

    if not isinstance(env, TransformedEnv) or type(env.base_env) is not ChatEnv:
        return False
    transform = env.transform
    transforms = list(transform) if isinstance(transform, Compose) else [transform]
    return all(type(t) in (DataLoadingPrimer, StepCounter, InitTracker) for t in transforms)


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
    ``(seed, k, row_offset + i)`` (:func:`~rlhf_torchrl.sampling.row_stream_seeds`): a process that
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
        total = -1 if total_batches < 0 else total_batches * batch_size
        self.collector = _OneTurnCollector(
            env, policy=policy, dialog_turns_per_batch=batch_size, total_dialog_turns=total
        )

    def __iter__(self) -> Iterator[TensorDict]:
        from ..sampling import row_stream_seeds

        if self.records:
            self.sampler.pop()  # nothing recorded outside this loop belongs to its batches
        if self.value_recorder is not None:
            self.value_recorder.pop()
        batches = iter(self.collector)
        rows = range(self.row_offset, self.row_offset + self.batch_size)
        for index in itertools.count(self.start_batch):
            if self.seed is not None:  # the streams of the batch the collector generates next
                self.sampler.set_streams(row_stream_seeds(self.seed, index, rows))
            batch = next(batches, None)
            if batch is None:
                return
            rollout = to_rollout(
                batch,
                pad_token_id=self.tokenizer.pad_token_id,
                stop_token_ids=self.stop_token_ids,
                tokenizer=self.tokenizer,
            )
            group_rows = torch.arange(self.row_offset, self.row_offset + rollout.shape[0])
            rollout.set(K.GROUP, group_rows // self.samples_per_prompt)
            if self.records or self.value_recorder is not None:
                self._add_sampling_record(rollout, batch)
            yield rollout if self.device is None else rollout.to(self.device)

    def _add_sampling_record(self, rollout: TensorDict, batch: TensorDictBase) -> None:
        """Write what the sampling pass recorded for this batch, 0 on pads: the sampled tokens'
        log-probs (and entropies) (B, R), and the values (B, R, 1) of a value recorder."""
        log_probs, entropies = self.sampler.pop() if self.records else (None, None)
        values = self.value_recorder.pop() if self.value_recorder is not None else None
        generated = batch.get(K.RESPONSE_TOKENS, as_padded_tensor=True).shape[-1]
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
        self.collector.shutdown()
