"""A reward model: a Hugging Face sequence classifier scoring ``prompt + response`` text as
:class:`~rlhf_torchrl.rewards.scoring.Scorer` calls a reward function."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDictBase

from rlhf_torchrl import keys as K
from rlhf_torchrl.errors import ConfigError


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
        from rlhf_torchrl.runtime import module_device

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
        # (rlhf_torchrl.rewards.training); 0 for any other classifier
        self.offset = float(getattr(model.config, "reward_offset", 0.0) or 0.0)

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, dtype: str = "float32", **kwargs) -> RewardModel:
        from rlhf_torchrl.modules.models import load_sequence_classifier

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
        from rlhf_torchrl.runtime import placed

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
