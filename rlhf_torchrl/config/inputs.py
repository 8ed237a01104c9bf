"""The run's prompts from ``data.*``: loaded, length-checked, the held-out ones split off, and
their evaluator (``eval.*``).
"""

from __future__ import annotations

import logging

from omegaconf import DictConfig, OmegaConf

from rlhf_torchrl.config.components import make_tools
from rlhf_torchrl.config.derived import eval_prompt_count
from rlhf_torchrl.config.model_checks import check_sequence_length
from rlhf_torchrl.data import load_prompts
from rlhf_torchrl.data.prompt_sets import CHECK_ALL_UP_TO, PromptMixture, PromptSet
from rlhf_torchrl.data.prompts import LengthCheck
from rlhf_torchrl.errors import ConfigError

log = logging.getLogger(__name__)


def system_prompt(cfg: DictConfig, tools: dict | None = None) -> str | None:
    """``data.system_prompt``, followed by the tools' descriptions when the episode has tools
    (``env.describe_tools``).

    Args:
        cfg: the composed PPO config.
        tools: the loaded ``env.tools`` (:func:`~rlhf_torchrl.config.components.make_tools`;
            None: loaded here).
    """
    from rlhf_torchrl.envs.tools import describe_tools

    prompt = cfg.data.system_prompt
    if cfg.env.tools and cfg.env.describe_tools:
        described = describe_tools(tools if tools is not None else make_tools(cfg))
        prompt = f"{prompt}\n\n{described}" if prompt else described
    return prompt


def make_prompts(cfg: DictConfig, tokenizer, tools: dict | None = None) -> PromptSet | PromptMixture:
    """The prompts of ``data.source`` (or the mixture of ``data.sources``), each held to
    ``data.max_prompt_length`` tokens; checked whole now, or as batches serve them
    (``data.check_prompts``). ``tools``: the loaded ``env.tools`` their system prompt describes
    (None: loaded here)."""
    d = cfg.data
    system = system_prompt(cfg, tools)
    if d.sources:
        prompts = PromptMixture([_load_source(cfg, entry, system) for entry in d.sources],
                                [entry.weight for entry in d.sources],
                                [f"data.sources[{i}] ({e.source})" for i, e in enumerate(d.sources)])
    else:
        prompts = _load_source(cfg, d, system)
    prompts = prompts.with_length_check(LengthCheck(
        tokenizer, d.max_prompt_length, truncate=d.truncate_prompts, side=d.truncate_side,
        at=d.truncate_at))
    if d.check_prompts == "all" or (d.check_prompts == "auto" and len(prompts) <= CHECK_ALL_UP_TO):
        n_truncated = prompts.check()
        if n_truncated:
            log.warning("Cut %d of %d prompts to %d tokens (data.truncate_side=%s).",
                        n_truncated, len(prompts), d.max_prompt_length, d.truncate_side)
    else:
        log.info("%d prompts: each is made and its length checked when a batch serves it "
                 "(data.check_prompts=%s; all: every one before training).", len(prompts),
                 d.check_prompts)
    held_out = eval_prompt_count(cfg)
    per_batch = cfg.ppo.batch_size // cfg.generation.samples_per_prompt
    if len(prompts) - held_out < per_batch:
        raise ConfigError(
            f"The prompt set has {len(prompts)} prompts, {held_out} of them held out for evaluation "
            f"(eval.num_prompts): fewer than the {per_batch} of a batch (ppo.batch_size="
            f"{cfg.ppo.batch_size} / generation.samples_per_prompt={cfg.generation.samples_per_prompt})"
            f" are left to train on. {_what_fits(len(prompts), held_out, per_batch, cfg)}Add "
            "prompts, lower the batch size or eval.num_prompts, or set eval.every=0."
        )
    return prompts


def _load_source(cfg: DictConfig, entry: DictConfig, system: str | None,
                 whole: bool = False) -> PromptSet:
    """One source's prompts: ``entry`` is ``data`` itself or a ``data.sources`` entry, whose
    loading settings left null are ``data``'s; ``whole``: every row (no ``data.limit``)."""
    d = cfg.data

    def setting(key):
        value = entry.get(key)
        return d[key] if value is None else value

    try:
        return load_prompts(entry.source, split=setting("split"), column=setting("column"),
                            template=setting("template") or "{prompt}",
                            limit=None if whole else setting("limit"),
                            max_words=d.max_words, system_prompt=system, config=setting("config"),
                            generator_args=(OmegaConf.to_container(d.generator_args, resolve=True)
                                            if d.generator_args else {}),
                            seed=cfg.seed, check=False)
    except ConnectionError as e:  # an HF dataset name, offline or unknown
        setting = "eval.source" if whole else "data.source"
        raise ConfigError(f"{setting}={entry.source}: not a local file, and the dataset hub could "
                          f"not give it ({e}). Give a local file (.jsonl, .json, .parquet, .csv, "
                          ".tsv), a saved dataset's folder, 'polarity', or a dataset name reachable "
                          "from here.") from None


def _what_fits(n: int, held_out: int, per_batch: int, cfg: DictConfig) -> str:
    """A setting that fits ``n`` prompts: fewer held out (an eighth of them) when a batch is then
    left to train on, else a smaller batch."""
    k = min(n - per_batch, max(1, n // 8))
    if held_out and k >= 1:
        return f"E.g. eval.num_prompts={k} leaves {n - k} to train on. "
    left = n - (min(held_out, max(1, n // 8)) if held_out else 0)
    if left >= 1:
        shown = f"eval.num_prompts={n - left} with " if held_out and n - left != held_out else ""
        return f"E.g. {shown}ppo.batch_size={left * cfg.generation.samples_per_prompt} or less. "
    return ""


def split_eval_prompts(cfg: DictConfig, prompts, tokenizer=None, tools: dict | None = None) -> tuple:
    """(training prompts, held-out evaluation prompts): the last ``eval.num_prompts`` rows (of
    each source of a mixture, shared by weight: :meth:`~rlhf_torchrl.data.prompt_sets.PromptMixture.hold_out`);
    with ``eval.source``, every prompt and that file's (:func:`make_eval_prompts`).

    Args:
        cfg: the composed PPO config.
        prompts (Sequence | PromptSet | PromptMixture): the prompts.
        tokenizer (transformers.PreTrainedTokenizerBase | None): the policy's, which checks the
            lengths of ``eval.source``'s prompts (needed with it).
        tools: the loaded ``env.tools`` their system prompt describes (None: loaded here).
    """
    if cfg.eval.every and OmegaConf.select(cfg, "eval.source"):
        return prompts, make_eval_prompts(cfg, tokenizer, tools)
    k = eval_prompt_count(cfg)
    return hold_out(prompts, k) if k else (prompts, [])


def make_eval_prompts(cfg: DictConfig, tokenizer, tools: dict | None = None) -> PromptSet:
    """Every prompt of ``eval.source`` (no ``data.limit``), read with ``data``'s column, template,
    split, config and system prompt, each held to ``data.max_prompt_length`` tokens and checked
    now (a bad row or an over-long prompt stops here, before any model loads).

    Args:
        cfg: the composed PPO config.
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer.
        tools: the loaded ``env.tools`` their system prompt describes (None: loaded here).
    """
    d = cfg.data
    prompts = _load_source(cfg, OmegaConf.create({"source": cfg.eval.source}),
                           system_prompt(cfg, tools), whole=True)
    prompts = prompts.with_length_check(LengthCheck(
        tokenizer, d.max_prompt_length, truncate=d.truncate_prompts, side=d.truncate_side,
        at=d.truncate_at))
    n_truncated = prompts.check()
    check_sequence_length(cfg, prompts, tokenizer)
    if n_truncated:
        log.warning("Cut %d of the %d prompts of eval.source to %d tokens (data.truncate_side=%s).",
                    n_truncated, len(prompts), d.max_prompt_length, d.truncate_side)
    return prompts


def hold_out(prompts, k: int) -> tuple:
    """``(training prompts, the k held out)`` of a prompt set, a mixture or a list.

    Args:
        prompts (Sequence | PromptSet | PromptMixture): the prompts.
        k: how many to hold out.
    """
    return prompts.hold_out(k) if hasattr(prompts, "hold_out") else (prompts[:-k], prompts[-k:])


def make_evaluator(cfg: DictConfig, held_out, tokenizer, scorer, stop_ids, device, parallel,
                   tools: dict | None = None):
    """The held-out evaluator (rank 0; None when eval.every=0, or under FSDP2, whose sharded
    forward needs every process); ``tools``: the loaded ``env.tools`` (None: loaded here)."""
    e = cfg.eval
    if not e.every or not parallel.is_main:
        return None
    if parallel.fsdp:
        log.warning("eval.every: evaluation is not run under FSDP2 yet (its forward is collective).")
        return None
    return new_evaluator(cfg, held_out, tokenizer, scorer, stop_ids, device, tools)


def new_evaluator(cfg: DictConfig, prompts, tokenizer, scorer, stop_ids, device,
                  tools: dict | None = None):
    """An :class:`~rlhf_torchrl.trainers.evaluation.Evaluator` of ``prompts`` with the ``eval.*`` settings.

    Args:
        cfg: the composed PPO config.
        prompts (Sequence): the held-out prompts.
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer.
        scorer (rlhf_torchrl.rewards.scoring.Scorer): scores the responses.
        stop_ids (list[int]): the ids that end a response.
        device (torch.device): where the evaluation samples.
        tools: the loaded ``env.tools`` of its episodes (None: loaded here).
    """
    from rlhf_torchrl.trainers.evaluation import Evaluator

    e = cfg.eval
    judge = e.judge or ("reward_model" if cfg.reward.model or cfg.reward.remote_url else None)
    env = cfg.env
    if env.tools and tools is None:
        tools = make_tools(cfg)
    episode = ({"tools": tools, "max_turns": env.max_turns, "max_tokens": env.max_tokens,
                "tool_timeout": env.tool_timeout} if env.tools else None)
    return Evaluator(prompts, tokenizer, scorer,
                     max_new_tokens=e.max_new_tokens or cfg.generation.max_new_tokens,
                     temperature=e.temperature, stop_token_ids=stop_ids, seed=cfg.seed, judge=judge,
                     accuracy=e.accuracy_reward, device=device, episode=episode,
                     samples_per_prompt=e.samples_per_prompt,
                     ks=list(e.k) if e.k is not None else None, batch_size=e.batch_size)
