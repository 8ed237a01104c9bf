"""Process reward models: a Hugging Face model that scores each reasoning step of a response.

Two kinds of model, told apart by their config's architecture:

- **token classification** (``AutoModelForTokenClassification``, TRL's ``PRMTrainer``): its input
  is the prompt, then each step followed by ``step_separator``, each piece tokenised on its own
  (TRL's layout); a step's score is read at its last token (the separator's), ``P(label 1)`` of
  two labels, or the sigmoid of one.
- **step tag** (a causal LM in Math-Shepherd's style, Wang et al. 2024): its input is
  ``f"{prompt} {step_1} {tag}\\n{step_2} {tag}..."``; a step's score is the probability of the
  ``good`` token against the ``bad`` one (``"+"`` and ``"-"``) from the logits at its tag
  (Math-Shepherd's inference code).

Either is a step reward function (:mod:`rlhf_torchrl.rewards.steps`): it scores the steps the run
splits each response into, with its own tokenizer (the text is tokenised again, so the PRM's
vocabulary need not be the policy's), and its values land on each step's last policy token. As
an entry of ``reward.functions``: ``prm:<model directory or hub id>`` (:class:`ProcessRewardKind`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhf_torchrl import keys as K
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.rewards.kinds import REWARD_KINDS, RewardKind
from rlhf_torchrl.rewards.scoring import RewardError

#: the two kinds of process reward model
STYLES = ("token_classification", "step_tag")


class ProcessRewardModel:
    """Scores each step of each response with a process reward model (see the module docstring).

    A step reward function: ``prm(prompts, responses, steps, tensordict, **columns)`` returns one
    list per response, one float per step. Runs without grad, ``batch_size`` responses per forward.

    Args:
        model (torch.nn.Module): a token classifier (one or two labels) or a causal LM.
        tokenizer (transformers.PreTrainedTokenizerBase): the PRM's own tokenizer.
        style: ``token_classification`` or ``step_tag`` (None: from the model's class).
        step_tag: step-tag PRMs: the token after each step (Math-Shepherd: ``"ки"``).
        good_token: step-tag PRMs: the token that says a step is right (``"+"``).
        bad_token: step-tag PRMs: the token that says a step is wrong (``"-"``).
        step_separator: token-classification PRMs: the text after each step (TRL: ``"\\n"``).
        prompt_column: the dataset column the PRM reads as the question (None: the prompt's last
            user message, without the policy's chat template; the prompt as the policy read it
            where the rollout has no conversations).
        batch_size: responses per forward.
        max_length: the longest input in tokens, cut from the left (None: the model's
            ``max_position_embeddings``).
        device: where it scores (None: where the model is).
        offload: the model lives on the CPU and visits ``device`` only while it scores.
        name: its name in errors.

    Example:
        >>> prm = ProcessRewardModel.from_pretrained("peiyi9979/math-shepherd-mistral-7b-prm")
        >>> prm(["Q: 2 + 3 * 4?"], ["3 * 4 = 12\\n2 + 12 = 14"], steps=[["3 * 4 = 12", "2 + 12 = 14"]])
        [[0.97, 0.95]]
    """

    def __init__(self, model, tokenizer, *, style: str | None = None, step_tag: str = "ки",
                 good_token: str = "+", bad_token: str = "-", step_separator: str = "\n",
                 prompt_column: str | None = None, batch_size: int = 8,
                 max_length: int | None = None, device=None, offload: bool = False,
                 name: str = "prm"):
        from rlhf_torchrl.runtime import module_device

        self.name = name
        self.style = style or model_style(model.config, name, fallback=type(model).__name__)
        if self.style not in STYLES:
            raise ConfigError(f"Process reward model {name!r}: style {self.style!r} is not one of "
                              f"{', '.join(STYLES)}.")
        self.device = torch.device(device) if device is not None else module_device(model)
        self.offload = offload
        self.model = model.eval().to("cpu" if offload else self.device)
        self.tokenizer, self.batch_size = tokenizer, batch_size
        self.prompt_column, self.step_tag, self.step_separator = prompt_column, step_tag, step_separator
        self.max_length = max_length or getattr(model.config, "max_position_embeddings", None)
        self.pad_id = tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        if self.style == "token_classification":
            labels = int(model.config.num_labels)
            if labels not in (1, 2):
                raise ConfigError(
                    f"Process reward model {name!r} classifies tokens into {labels} labels: a PRM "
                    "has 2 (bad, good: the score is P(good)) or 1 (the score is its sigmoid).")
            self.separator_ids = tokenizer(step_separator, add_special_tokens=False)["input_ids"]
            if not self.separator_ids:
                raise ConfigError(f"Process reward model {name!r}: reward.prm_step_separator="
                                  f"{step_separator!r} has no tokens: a step's score is read at "
                                  "its separator's last token.")
        else:
            self.tag_id = single_token(tokenizer, step_tag, name, "reward.prm_step_tag")
            self.candidate_ids = [single_token(tokenizer, good_token, name, "reward.prm_good_token"),
                                  single_token(tokenizer, bad_token, name, "reward.prm_bad_token")]
            if self.candidate_ids[0] == self.candidate_ids[1]:
                raise ConfigError(f"Process reward model {name!r}: the good and bad tokens "
                                  f"({good_token!r}, {bad_token!r}) are the same token.")

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, dtype: str = "float32",
                        **kwargs) -> ProcessRewardModel:
        """Load a PRM (either style: :func:`model_style`) and its tokenizer; one line if it
        cannot be loaded.

        Args:
            name_or_path: a local directory, a hub id or a built-in alias.
            dtype: the weights' dtype.
            **kwargs: :class:`ProcessRewardModel`'s settings.
        """
        from transformers import (
            AutoConfig,
            AutoModelForCausalLM,
            AutoModelForTokenClassification,
            AutoTokenizer,
        )

        from rlhf_torchrl.modules.models import disable_dropout, resolve_model_path, torch_dtype
        from rlhf_torchrl.runtime import quiet_loading_bars
        from rlhf_torchrl.safe_loading import refusing_code

        name = kwargs.get("name", "prm")
        path = resolve_model_path(name_or_path)
        try:
            config = AutoConfig.from_pretrained(path)
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, KeyError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"Process reward model {name!r} ({name_or_path}) cannot be loaded: "
                              f"{first}. Give a model directory or hub id with a config.json, "
                              "weights and a tokenizer.") from None
        style = kwargs.pop("style", None) or model_style(config, name)
        auto = AutoModelForTokenClassification if style == "token_classification" else AutoModelForCausalLM
        with refusing_code(path), quiet_loading_bars():
            model = auto.from_pretrained(path, dtype=torch_dtype(dtype))
        return cls(disable_dropout(model), tokenizer, style=style, **kwargs)

    # ---- the step reward function --------------------------------------------------------------
    def __call__(self, prompts: list[str], responses: list[str], steps: list[list[str]],
                 tensordict=None, **columns) -> list[list[float]]:
        questions = prompts
        if self.prompt_column is None and tensordict is not None and K.PROMPT_MESSAGES in tensordict.keys(True):
            questions = [last_user_message(m, p) for m, p in
                         zip(tensordict.get(K.PROMPT_MESSAGES).tolist(), prompts)]
        if self.prompt_column is not None:
            if self.prompt_column not in columns:
                raise ConfigError(f"Process reward model {self.name!r} reads the dataset column "
                                  f"{self.prompt_column!r} (reward.prm_prompt_column), which the "
                                  f"prompts lack: they carry {sorted(columns) or 'no columns'}.")
            questions = [str(q) for q in columns[self.prompt_column]]
        return self.score_steps(questions, steps)

    @torch.no_grad()
    def score_steps(self, questions: Sequence[str], steps: Sequence[Sequence[str]]) -> list[list[float]]:
        """Each step's score, one list per response.

        Args:
            questions: what each response answers.
            steps: each response's steps.
        """
        from rlhf_torchrl.runtime import placed

        encoded = [self.encode(q, s, row) for row, (q, s) in enumerate(zip(questions, steps))]
        out: list[list[float]] = [[] for _ in encoded]
        todo = [i for i, (_, positions) in enumerate(encoded) if positions]  # responses with steps
        with placed(self.model, self.device, self.offload):
            for k in range(0, len(todo), self.batch_size):
                rows = todo[k:k + self.batch_size]
                width = max(len(encoded[i][0]) for i in rows)
                ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
                attention = torch.zeros((len(rows), width), dtype=torch.long)
                for j, i in enumerate(rows):  # right-padded
                    ids[j, :len(encoded[i][0])] = torch.tensor(encoded[i][0])
                    attention[j, :len(encoded[i][0])] = 1
                logits = self.model(input_ids=ids.to(self.device),
                                    attention_mask=attention.to(self.device)).logits.float()
                for j, i in enumerate(rows):
                    out[i] = self._scores(logits[j, encoded[i][1]]).tolist()
        return out

    def _scores(self, logits: torch.Tensor) -> torch.Tensor:
        """(S,) step scores from the logits at the S steps' positions (S, L)."""
        if self.style == "step_tag":
            return logits[:, self.candidate_ids].softmax(-1)[:, 0]  # P(good) against bad
        if logits.shape[-1] == 1:
            return logits[:, 0].sigmoid()
        return logits.softmax(-1)[:, 1]

    def encode(self, question: str, steps: Sequence[str], row: int = 0) -> tuple[list[int], list[int]]:
        """The PRM's input ids for one response and the position of each step's score.

        Args:
            question: what the response answers.
            steps: its steps.
            row: its row, for errors.
        """
        if not steps:
            return [], []
        if self.style == "step_tag":
            ids, positions = self._encode_tagged(question, steps, row)
        else:
            ids, positions = self._encode_separated(question, steps)
        cut = len(ids) - self.max_length if self.max_length else 0
        if cut > 0:  # keep the end: the steps, and as much of the question as fits
            if cut > positions[0]:
                raise RewardError(
                    f"Process reward model {self.name!r}: row {row}'s steps are longer than its "
                    f"{self.max_length} tokens: lower generation.max_new_tokens.")
            ids, positions = ids[cut:], [p - cut for p in positions]
        return ids, positions

    def _encode_separated(self, question: str, steps: Sequence[str]) -> tuple[list[int], list[int]]:
        """TRL's ``PRMTrainer.tokenize_row``: BOS, the prompt, each step then the separator."""
        tok = self.tokenizer
        ids = tok(question, add_special_tokens=False)["input_ids"]
        if tok.bos_token_id is not None:
            ids = [tok.bos_token_id, *ids]
        positions = []
        for step in steps:
            ids += tok(step, add_special_tokens=False)["input_ids"] + self.separator_ids
            positions.append(len(ids) - 1)
        return ids, positions

    def _encode_tagged(self, question: str, steps: Sequence[str], row: int) -> tuple[list[int], list[int]]:
        """Math-Shepherd's ``f"{question} {output}"``, each step ending in `` {tag}``; the tags
        found by id (a tag inside the text is dropped first)."""
        tag = self.step_tag
        text = (question.replace(tag, "") + " "
                + "\n".join(f"{step.replace(tag, '')} {tag}" for step in steps))
        ids = self.tokenizer(text)["input_ids"]
        positions = [i for i, token in enumerate(ids) if token == self.tag_id]
        if len(positions) != len(steps):
            raise RewardError(
                f"Process reward model {self.name!r}: row {row}'s input holds {len(positions)} "
                f"step tags {tag!r} (token {self.tag_id}) for {len(steps)} steps: its tokenizer "
                "merges the tag with its neighbours; give reward.prm_step_tag as the token its "
                "vocabulary writes after a space.")
        return ids, positions


def last_user_message(messages: list[dict], default: str) -> str:
    """The content of the last ``user`` message of a conversation (``default`` without one).

    Args:
        messages: ``{"role", "content"}`` dicts.
        default: the text where no message is the user's.
    """
    for message in reversed(messages or []):
        if message.get("role") == "user":
            return str(message.get("content", ""))
    return default


def model_style(config, name: str = "prm", fallback: str | None = None) -> str:
    """``token_classification`` or ``step_tag``, from a model config's architecture.

    Args:
        config (transformers.PretrainedConfig): the PRM's config.
        name: its name in errors.
        fallback: the model's class name, where the config states no architecture (a model
            built from a config, never saved).
    """
    architectures = list(getattr(config, "architectures", None) or ([fallback] if fallback else []))
    for arch in architectures:
        if arch.endswith("ForTokenClassification"):
            return "token_classification"
        if arch.endswith(("ForCausalLM", "LMHeadModel")):
            return "step_tag"
    raise ConfigError(
        f"Process reward model {name!r} is a {', '.join(architectures) or 'model of no stated architecture'}: "
        "a PRM is a token classifier (AutoModelForTokenClassification, TRL's PRMTrainer) or a "
        "causal LM that writes a good/bad token after each step tag (Math-Shepherd).")


def single_token(tokenizer, text: str, name: str, setting: str) -> int:
    """The id of ``text`` as one token of ``tokenizer``'s vocabulary (a token name, or a text
    that encodes to one token); one line if it is none.

    Args:
        tokenizer (transformers.PreTrainedTokenizerBase): the PRM's tokenizer.
        text: the token.
        name: the PRM's name, for errors.
        setting: the setting that gave ``text``, for errors.
    """
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
    if len(ids) == 1:
        return int(ids[0])
    vocab = tokenizer.get_vocab()
    if text in vocab:
        return int(vocab[text])
    raise ConfigError(
        f"Process reward model {name!r}: {setting}={text!r} is not a token of its vocabulary (it "
        f"encodes to {len(ids)} tokens): give the token its training wrote (Math-Shepherd: tag "
        "'ки', good '+', bad '-').")


@REWARD_KINDS.register("prm")
class ProcessRewardKind(RewardKind):
    """``prm:<model directory or hub id>``: a process reward model's score of each step
    (:class:`ProcessRewardModel`), with the ``reward.prm_*`` and ``reward.step_*`` settings and
    the reward model's dtype, batch size, device and offloading."""

    @classmethod
    def matches(cls, spec: str) -> bool:
        return spec.startswith("prm:")

    @classmethod
    def short_name(cls, spec: str) -> str:
        return "prm"

    @classmethod
    def full_name(cls, spec: str) -> str:
        return "prm_" + spec[len("prm:"):].rstrip("/").replace("/", "_").replace(".", "_")

    @classmethod
    def build(cls, spec: str, name: str, cfg):
        from rlhf_torchrl.rewards.steps import unescape
        from rlhf_torchrl.runtime import resolve_device

        path, r = spec[len("prm:"):], cfg.reward
        if not path:
            raise ConfigError("reward.functions entry 'prm:' names no model: write "
                              "prm:<model directory or hub id>.")
        return ProcessRewardModel.from_pretrained(
            path, dtype=r.model_dtype, name=name, step_tag=r.prm_step_tag,
            good_token=r.prm_good_token, bad_token=r.prm_bad_token,
            step_separator=unescape(r.prm_step_separator), prompt_column=r.prm_prompt_column,
            batch_size=r.model_batch_size, device=resolve_device(cfg.device), offload=r.offload)
