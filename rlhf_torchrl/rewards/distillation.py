"""On-policy distillation: a teacher's log-probs of the policy's own samples, from which the reward
shaper makes a per-token reward of minus the reverse KL to the teacher, beside (or in place of)
the scalar score.

- :class:`TeacherLogProbs`: a teacher with the policy's vocabulary; its log-probs of the sampled
  tokens, ``("teacher_log_probs", "response")`` (B, R), computed as the reference's are (its own
  model, fp32, at the sampling temperature, the prompt left-padded).
- :class:`TextTeacherLogProbs`: a teacher of another vocabulary (``reward.teacher_mapping=text``):
  each response's text re-tokenised for it, one log-prob per response,
  ``("teacher_log_probs", "sequence")`` (B,).
- :func:`vocabulary_difference` / :func:`check_same_vocabulary`: whether two tokenizers give the
  same ids to the same tokens (from their files, before any weights load).
- :func:`load_teacher`: the teacher model, frozen.

The reward itself: :class:`~rlhf_torchrl.objectives.kl_shaping.KLRewardShaper`
(``teacher_coef``, ``teacher_kl_estimator``) and
:func:`~rlhf_torchrl.functional.distillation_rewards`. In a TorchRL loop of your own::

    teacher = TeacherLogProbs(load_teacher("outputs/run/policy", tokenizer), temperature=0.7)
    compute_old_quantities(rollout, actor=actor, reference=ref_actor)
    teacher(rollout)   # ("teacher_log_probs", "response")
    shaper(rollout)    # r[t] = -kl_coef KL_ref[t] - teacher_coef KL_teacher[t] (+ score at the end)
"""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torch import nn

from rlhf_torchrl import keys as K
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.modules.actor import TokenLevelActor
from rlhf_torchrl.modules.models import load_causal_lm
from rlhf_torchrl.modules.sequences import IN_KEYS, model_input_keys
from rlhf_torchrl.runtime import placed

#: ``reward.teacher_mapping``: token (the same vocabulary: per-token log-probs) | text (another
#: vocabulary: the response's text re-tokenised, one sequence-level log-prob)
MAPPINGS = ("token", "text")


def vocabulary_difference(tokenizer, teacher_tokenizer) -> str | None:
    """How ``teacher_tokenizer``'s token-to-id map differs from ``tokenizer``'s, in a few words;
    None where they are the same map (the per-token KL can compare their log-probs).

    Args:
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's.
        teacher_tokenizer (transformers.PreTrainedTokenizerBase): the teacher's.

    Example:
        >>> vocabulary_difference(tok, tok) is None
        True
    """
    ours, theirs = tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if ours == theirs:
        return None
    if len(ours) != len(theirs):
        return f"{len(theirs)} tokens against the policy's {len(ours)}"
    token = min((t for t in ours if theirs.get(t) != ours[t]), key=ours.__getitem__)
    where = f"id {theirs[token]}" if token in theirs else "no id"
    return f"token {token!r} has {where} there and id {ours[token]} in the policy's"


def check_same_vocabulary(tokenizer, teacher_tokenizer, teacher: str = "the teacher") -> None:
    """One-line :class:`~rlhf_torchrl.errors.ConfigError` unless both tokenizers map the same
    tokens to the same ids (:func:`vocabulary_difference`).

    Args:
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's.
        teacher_tokenizer (transformers.PreTrainedTokenizerBase): the teacher's.
        teacher: how the error names the teacher (e.g. ``"reward.teacher=Qwen/Qwen2.5-0.5B"``).
    """
    difference = vocabulary_difference(tokenizer, teacher_tokenizer)
    if difference is not None:
        raise ConfigError(
            f"{teacher} has another vocabulary than the policy ({difference}): its per-token "
            "log-probs cannot be compared with the policy's. Use a teacher with the policy's "
            "tokenizer, or reward.teacher_mapping=text (the response's text re-tokenised for the "
            "teacher, a sequence-level KL at the last token).")


def load_teacher(name_or_path: str, tokenizer=None, *, dtype: str = "float32",
                 attn_implementation: str | None = None, device: torch.device | str = "cpu",
                 offload: bool = False) -> nn.Module:
    """The teacher causal LM, frozen (eval mode, no grad), on ``device`` (on the CPU with
    ``offload``: :class:`TeacherLogProbs` brings it to the rollout's device while it runs).

    Args:
        name_or_path: a Hub name, a local directory (a run's saved ``policy/``), or a built-in
            alias.
        tokenizer (transformers.PreTrainedTokenizerBase | None): the tokenizer it reads: its
            embeddings are grown to it where they are smaller (None: as loaded).
        dtype: ``float32``, ``bfloat16`` or ``float16`` (its weights; log-probs are fp32).
        attn_implementation: the attention kernel (None: transformers' default).
        device: where it runs.
        offload: keep it on the CPU between its forwards.
    """
    model = load_causal_lm(name_or_path, tokenizer, dtype=dtype,
                           attn_implementation=attn_implementation)
    model.eval().requires_grad_(False)
    return model.to("cpu" if offload else device)


class TeacherLogProbs(TensorDictModuleBase):
    """The teacher's log-probs of the sampled response tokens, for the reverse KL to it.

    Runs the teacher (a causal LM with the policy's vocabulary) on ``[prompt | response]`` as the
    reference runs (:class:`~rlhf_torchrl.modules.TokenLevelActor`: the prompt left-padded, the
    position ids from the attention mask, the LM head on the response positions alone, logits in
    fp32 divided by the sampling ``temperature``), without grad, ``chunk_size`` rows at a time.
    Writes ``("teacher_log_probs", "response")``: ``log pi_T(y_t | x, y_<t)``, 0 on pads.

    Args:
        model: the teacher (:func:`load_teacher`).
        temperature: the sampling temperature (the policy's log-probs are taken at it too).
        chunk_size: rows per forward.
        offload: the teacher lives on the CPU and visits the rollout's device while it runs.
        autocast_dtype: the trunk runs under ``torch.autocast`` in this dtype, the LM head and the
            log-probs in fp32 (None: no autocast).
        packing: packed forwards (:mod:`~rlhf_torchrl.modules.packing`).

    Shapes: reads (B, P) and (B, R) tokens/masks; writes (B, R) float32.

    Example:
        >>> teacher = TeacherLogProbs(load_teacher(teacher_dir, tokenizer), temperature=0.7)
        >>> teacher(rollout)[("teacher_log_probs", "response")].shape  # (B, R)
    """

    def __init__(self, model: nn.Module, *, temperature: float = 1.0, chunk_size: int = 16,
                 offload: bool = False, autocast_dtype: torch.dtype | None = None,
                 packing: bool | str = False):
        super().__init__()
        self.actor = TokenLevelActor(model, temperature=temperature, out_key=K.TEACHER_LOG_PROB,
                                     autocast_dtype=autocast_dtype, packing=packing)
        self.chunk_size, self.offload = chunk_size, offload
        self.in_keys = list(IN_KEYS)
        self.out_keys = [K.TEACHER_LOG_PROB]

    @property
    def model(self) -> nn.Module:
        return self.actor.model

    @torch.no_grad()
    def forward(self, td: TensorDictBase) -> TensorDictBase:
        K.require(td, *self.in_keys, what="TeacherLogProbs")
        device = td.get(K.RESPONSE_TOKENS).device
        parts = []
        with placed(self.model, device, self.offload):
            for chunk in td.select(*model_input_keys(td)).split(self.chunk_size):
                parts.append(self.actor(chunk.clone(False)).get(K.TEACHER_LOG_PROB))
        td.set(K.TEACHER_LOG_PROB, torch.cat(parts).float())
        return td


class TextTeacherLogProbs(TensorDictModuleBase):
    """A teacher of another vocabulary: each response's log-probability under it, from the text.

    The teacher reads the prompt rendered by its own tokenizer (the rollout's conversations,
    ``("messages", "prompt")``, through ``tokenizer``'s chat template; a rollout without them:
    the prompt text the policy read) and the response's text (``("text", "response")``)
    re-tokenised, followed by its EOS where the response stopped (the policy's log-probs count
    its stop token too). Writes ``("teacher_log_probs", "sequence")`` (B,):
    ``log pi_T(y | x) = sum_j log pi_T(y'_j | x', y'_<j)`` over the teacher's tokens ``y'``, in
    fp32 at the sampling ``temperature``. The shaper compares it with the policy's
    ``sum_t log pi(y_t)`` (:func:`~rlhf_torchrl.functional.sequence_distillation_rewards`): a
    sequence-level reverse KL, at the last token. Single responses only: a multi-turn episode's
    text interleaves the tools' messages.

    Args:
        model: the teacher (:func:`load_teacher` with ``tokenizer``).
        tokenizer (transformers.PreTrainedTokenizerBase): the teacher's (a pad token of its own:
            :func:`~rlhf_torchrl.modules.load_tokenizer`).
        temperature: the sampling temperature.
        chunk_size: rows per forward.
        offload: the teacher lives on the CPU and visits the rollout's device while it runs.
        autocast_dtype: the trunk's autocast dtype (None: none).
        use_messages: render the conversations with ``tokenizer``'s chat template where the
            rollout holds them (False: the prompt text as the policy read it, re-tokenised).

    Shapes: writes (B,) float32.

    Example:
        >>> teacher = TextTeacherLogProbs(load_teacher(qwen_dir, qwen_tok), qwen_tok, temperature=0.7)
        >>> teacher(rollout)[("teacher_log_probs", "sequence")].shape  # (B,)
    """

    def __init__(self, model: nn.Module, tokenizer, *, temperature: float = 1.0,
                 chunk_size: int = 16, offload: bool = False,
                 autocast_dtype: torch.dtype | None = None, use_messages: bool = True):
        super().__init__()
        if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
            raise ConfigError("TextTeacherLogProbs needs the teacher's tokenizer with a pad and an "
                              "EOS token: load it with rlhf_torchrl.modules.load_tokenizer.")
        self.actor = TokenLevelActor(model, temperature=temperature,
                                     out_key=("teacher_log_probs", "tokens"),
                                     autocast_dtype=autocast_dtype)
        self.tokenizer = tokenizer
        self.chunk_size, self.offload, self.use_messages = chunk_size, offload, use_messages
        self.in_keys = [K.PROMPT_TEXT, K.RESPONSE_TEXT, K.HAS_STOP]
        self.out_keys = [K.TEACHER_SEQUENCE_LOG_PROB]

    @property
    def model(self) -> nn.Module:
        return self.actor.model

    def prompt_texts(self, td: TensorDictBase) -> list[str]:
        """Each row's prompt as the teacher reads it.

        Args:
            td: the rollout.
        """
        if self.use_messages and K.PROMPT_MESSAGES in td.keys(True):
            from rlhf_torchrl.data.prompts import render_conversations

            return render_conversations(self.tokenizer, td.get(K.PROMPT_MESSAGES).tolist())
        return td.get(K.PROMPT_TEXT).tolist()

    def teacher_rollout(self, td: TensorDictBase) -> TensorDict:
        """The rollout's prompts and responses in the teacher's tokens: prompts left-padded,
        responses right-padded (EOS appended where the response stopped), at least one column
        each.

        Args:
            td: the rollout, with its texts.
        """
        observed = td.get(K.OBSERVATION_MASK, None)
        if observed is not None and bool(observed.any()):
            raise ConfigError("reward.teacher_mapping=text reads single responses: a multi-turn "
                              "episode's response interleaves the tools' messages (env.tools). "
                              "Use a teacher with the policy's tokenizer (teacher_mapping=token).")
        encode = self.tokenizer
        prompts = [encode(t, add_special_tokens=False)["input_ids"] for t in self.prompt_texts(td)]
        stopped = td.get(K.HAS_STOP).tolist()
        responses = [encode(t, add_special_tokens=False)["input_ids"] + ([encode.eos_token_id] if s else [])
                     for t, s in zip(td.get(K.RESPONSE_TEXT).tolist(), stopped)]
        device = td.get(K.HAS_STOP).device
        prompt, prompt_mask = _pad(prompts, encode.pad_token_id, left=True, device=device)
        response, response_mask = _pad(responses, encode.pad_token_id, left=False, device=device)
        return TensorDict({K.PROMPT_TOKENS: prompt, K.PROMPT_MASK: prompt_mask,
                           K.RESPONSE_TOKENS: response, K.RESPONSE_MASK: response_mask},
                          batch_size=[len(prompts)], device=device)

    @torch.no_grad()
    def forward(self, td: TensorDictBase) -> TensorDictBase:
        K.require(td, *self.in_keys, what="TextTeacherLogProbs")
        theirs = self.teacher_rollout(td)
        parts = []
        with placed(self.model, theirs.device, self.offload):
            for chunk in theirs.split(self.chunk_size):
                log_prob = self.actor(chunk.clone(False)).get(self.actor.out_keys[0])
                parts.append((log_prob.float() * chunk.get(K.RESPONSE_MASK)).sum(-1))
        td.set(K.TEACHER_SEQUENCE_LOG_PROB, torch.cat(parts))
        return td


def _pad(rows: list[list[int]], pad_id: int, *, left: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, W) token ids and their bool mask, ``W = max(1, longest row)``, padded on the left or
    the right."""
    width = max(1, max((len(r) for r in rows), default=0))
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        if row:
            span = slice(width - len(row), width) if left else slice(0, len(row))
            tokens[i, span] = torch.tensor(row, dtype=torch.long)
            mask[i, span] = True
    return tokens.to(device), mask.to(device)
