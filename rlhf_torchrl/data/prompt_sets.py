"""Prompt sets: a source's rows made into prompts when they are read, and mixtures of sources.

A :class:`PromptSet` holds one source's table (:mod:`rlhf_torchrl.data.readers`) and how a row becomes
a :class:`~rlhf_torchrl.data.prompts.Prompt`: the prompt column, ``data.template``, ``data.max_words``, the
system prompt and the length check. ``prompts[i]`` makes row ``i``'s prompt when asked, so a
memory-mapped million-row Parquet costs no Python objects until its batches are served. Its
columns are checked when it is made (the prompt column exists, holds text in every row or chat
messages in every row, and no row lacks one); its rows are checked either all at once
(:meth:`PromptSet.check`, before any work) or one by one as batches serve them.

A :class:`PromptMixture` serves several sets in proportion to their weights through
:class:`MixtureBatchSampler`, whose batches depend on the seed and the batch index alone: a
resumed run serves what the uninterrupted run would have served.
"""

from __future__ import annotations

import bisect
import copy
import itertools
import logging
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from rlhf_torchrl.data.prompts import Prompt, fill_template, template_columns, to_prompt
from rlhf_torchrl.data.readers import POLARITY, Table, read_table
from rlhf_torchrl.errors import ConfigError

log = logging.getLogger(__name__)

#: ``data.check_prompts=auto``: a set of up to this many prompts is checked whole before training
#: (~0.15 ms a prompt: its chat template and tokens), a larger one as batches serve it
CHECK_ALL_UP_TO = 100_000

#: the field a mixture's prompt carries its source in: the index of its set (``data.sources``'
#: entry), which per-source score normalisation reads (:class:`~rlhf_torchrl.rewards.length.PerSourceScoreNorm`)
#: and reward functions may ask for by name
SOURCE_COLUMN = "mixture_source"


class PromptSet(Sequence):
    """The prompts of one source, row ``i``'s made when ``prompts[i]`` is read.

    The prompt column becomes the conversation. Every other column travels with the prompt
    (:attr:`~rlhf_torchrl.data.prompts.Prompt.fields`). Rows in verl's schema (:func:`verl_schema`) also
    carry ``reward_model.ground_truth`` as the fields ``ground_truth`` and ``answer``; when
    ``column`` is not one of their columns, their ``prompt`` messages are taken as written
    (verl's preprocessing put the instructions in: ``template`` is not applied).

    ``length_check`` (a :class:`~rlhf_torchrl.data.prompts.LengthCheck`) holds every prompt read to the
    token budget, cut or refused. ``rows``: which rows of the table, in order (``data.limit``, the
    held-out split: slicing a set slices them).

    Args:
        table: the source's rows (:func:`~rlhf_torchrl.data.readers.read_table`).
        column: the prompt column: text, an HH transcript, or a list of chat messages.
        template: fills the last user message (``{prompt}``: that message, ``{name}``: the row's
            column); None: the message as written.
        max_words: cut the message to its first ``max_words`` words before templating (None:
            whole).
        system_prompt: put first in conversations without one (None: none).
        limit: the first ``limit`` rows (None: all).

    Example:
        >>> prompts = PromptSet(read_table("train.parquet"), column="question")
        >>> train, held_out = prompts.hold_out(64)  # the last 64 rows
        >>> train[0].text  # row 0, made now
    """

    def __init__(self, table: Table, *, column: str = "prompt", template: str | None = "{prompt}",
                 max_words: int | None = None, system_prompt: str | None = None,
                 limit: int | None = None):
        self.table = table
        self.rows = range(min(len(table.rows), limit or len(table.rows)))
        self.verl = verl_schema(table)
        if self.verl and column not in table.columns:
            log.info("%s is in verl's schema: its 'prompt' messages are the prompts, as written "
                     "(data.column=%s is not one of its columns; data.template is not applied); "
                     "reward_model.ground_truth is the field ground_truth (and answer).",
                     table.name, column)
            column, template = "prompt", None
        self.column, self.template = column, template
        self.max_words, self.system_prompt = max_words, system_prompt
        self.length_check = None
        #: the longest prompt's tokens, once :meth:`check` has measured every prompt (else None)
        self.longest: int | None = None
        self._check_columns()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._with(rows=self.rows[i])
        return self._prompt(self.rows[i])[0]

    def with_length_check(self, length_check) -> PromptSet:
        """The same prompts, each held to ``length_check`` when read.

        Args:
            length_check (rlhf_torchrl.data.prompts.LengthCheck | None): the check (None: none).
        """
        return self._with(length_check=length_check)

    def hold_out(self, k: int) -> tuple[PromptSet, PromptSet]:
        """``(training prompts, held-out prompts)``: the held-out ones are the last ``k`` rows.

        Args:
            k: the number of held-out prompts.
        """
        return self[: len(self) - k], self[len(self) - k:]

    def check(self) -> int:
        """Make (and length-check) every prompt now, so that a bad row fails before any work.
        Returns how many prompts the length check cut; sets :attr:`longest`."""
        cut, longest = 0, 0
        for j in self.rows:
            _, length, was_cut = self._prompt(j)
            cut += was_cut
            longest = max(longest, length or 0)
        self.longest = longest if self.length_check is not None else None
        return cut

    def _with(self, **changes) -> PromptSet:
        other = copy.copy(self)
        other.__dict__.update(changes, longest=None)
        return other

    def _prompt(self, j: int) -> tuple[Prompt, int | None, bool]:
        """Row ``j``'s prompt, its length in tokens (None without a length check), whether cut."""
        where = self.table.where(j)
        prompt = self._build(self.table.rows[j], where)
        if self.length_check is None:
            return prompt, None, False
        return self.length_check(prompt, f"The prompt at {where}")

    def _build(self, row: dict, where: str) -> Prompt:
        if self.column not in row:
            raise self._no_column(row, where)
        prompt = to_prompt(row[self.column], self.system_prompt, where)
        text = prompt.text
        if self.max_words is not None:
            text = " ".join(text.split()[: self.max_words])
        columns = {k: v for k, v in row.items() if k != self.column}
        if self.verl:
            reference = (row.get("reward_model") or {}).get("ground_truth")
            columns = {"ground_truth": reference, "answer": reference, **columns}
        fields = {**prompt.fields, **columns}
        if self.template is None:
            return Prompt(prompt.with_text(text).messages, fields)
        missing = [name for name in template_columns(self.template)
                   if name != "prompt" and (name not in columns or name == self.column)]
        if missing:
            raise ConfigError(
                f"{where}: data.template names {{{missing[0]}}}, which is not one of the row's "
                f"other fields {sorted(columns)}. Name a column of the data (the prompt column "
                "itself is {prompt})."
            )
        filled = prompt.with_text(fill_template(self.template, text, columns))
        return Prompt(filled.messages, fields, self.template, text)

    def _no_column(self, row: dict, where: str) -> ConfigError:
        return ConfigError(f"{where}: expected a {self.column!r} field (data.column); the row's "
                           f"fields are {sorted(row)}. Set data.column to the one holding the prompt.")

    def _check_columns(self) -> None:
        """The prompt column exists, holds one kind (text, or chat messages) and no nulls."""
        t = self.table
        if t.arrow is None:  # rows in memory: each row's own fields
            first = None
            for j in self.rows:
                row = t.rows[j]
                if self.column not in row:
                    raise self._no_column(row, t.where(j))
                kind = _kind(row[self.column])
                if kind not in ("text", "messages"):
                    raise ConfigError(f"{t.where(j)}: the prompt (data.column {self.column!r}) is "
                                      f"{kind}: expected text or a list of chat messages.")
                if first is None:
                    first = (kind, t.where(j))
                elif kind != first[0]:
                    raise ConfigError(
                        f"{t.where(j)}: the prompt (data.column {self.column!r}) is {kind} here but "
                        f"{first[0]} at {first[1]}: a prompt column holds text in every row, or a "
                        "list of chat messages in every row.")
            return
        if self.column not in t.columns:
            raise ConfigError(f"{t.name} has no column {self.column!r} (data.column); its columns "
                              f"are {list(t.columns)}. Set data.column to the one holding the prompt.")
        values = t.arrow.column(self.column)
        if _arrow_kind(values.type) is None:
            raise ConfigError(f"{t.name}: the column {self.column!r} (data.column) holds "
                              f"{values.type} values: a prompt is text or a list of chat messages "
                              "({'role': ..., 'content': ...}).")
        values = values.slice(self.rows.start, len(self.rows))
        if values.null_count:
            import pyarrow.compute as pc

            j = self.rows.start + pc.index(pc.is_null(values), True).as_py()
            raise ConfigError(f"{t.where(j)}: the prompt (data.column {self.column!r}) is empty "
                              "(null): every row needs one.")
        if self.template is not None:
            missing = [name for name in template_columns(self.template)
                       if name != "prompt" and (name not in t.columns or name == self.column)]
            if missing:
                raise ConfigError(
                    f"data.template names {{{missing[0]}}}, which is not one of {t.name}'s other "
                    f"columns {[c for c in t.columns if c != self.column]}. Name a column of the "
                    "data (the prompt column itself is {prompt}).")


def _kind(value) -> str:
    if isinstance(value, str):
        return "text"
    if isinstance(value, (list, tuple)):
        return "messages"
    return "empty (null)" if value is None else f"a {type(value).__name__}"


def _arrow_kind(arrow_type) -> str | None:
    """``text`` (a string column), ``messages`` (a list of ``{role, content}`` structs) or None."""
    import pyarrow as pa

    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return "text"
    if (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)) and \
            pa.types.is_struct(arrow_type.value_type):
        names = {arrow_type.value_type.field(i).name for i in range(arrow_type.value_type.num_fields)}
        return "messages" if {"role", "content"} <= names else None
    return None


def verl_schema(table: Table) -> bool:
    """Whether the rows are in verl's RL dataset schema (its ``examples/data_preprocess``):
    ``prompt`` a list of chat messages and ``reward_model`` a struct holding ``ground_truth``
    (next to ``data_source``, ``ability``, ``extra_info``).

    Args:
        table: the source's rows.
    """
    if "prompt" not in table.columns or "reward_model" not in table.columns:
        return False
    if table.arrow is None:
        row = table.rows[0]
        return (isinstance(row["prompt"], list) and isinstance(row["reward_model"], dict)
                and "ground_truth" in row["reward_model"])
    import pyarrow as pa

    schema = table.arrow.schema
    reward = schema.field("reward_model").type
    return (_arrow_kind(schema.field("prompt").type) == "messages" and pa.types.is_struct(reward)
            and reward.get_field_index("ground_truth") >= 0)


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split in proportion to ``weights``: the integer parts of the quotas, then one more
    to the largest remainders (ties: the earlier). ``apportion(5, [3, 1]) == [4, 1]``.

    Args:
        total: the count to split.
        weights: non-negative weights, one per part.
    """
    quotas = [total * w / sum(weights) for w in weights]
    shares = [int(q) for q in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda i: (shares[i] - quotas[i], i))
    for i in by_remainder[: total - sum(shares)]:
        shares[i] += 1
    return shares


class PromptMixture(Sequence):
    """Several prompt sets, served in proportion to their weights.

    Indices run over the sets one after another (set 0's rows, then set 1's, ...); the
    proportions are those of :class:`MixtureBatchSampler`, which
    :func:`~rlhf_torchrl.collectors.make_generation_env` uses for a mixture.

    Args:
        sets: the prompt sets.
        weights: one positive weight per set (relative: they need not sum to 1).
        names: the sets' names in messages (None: their sources).
        ids: each set's source id, which its prompts carry in the field :data:`SOURCE_COLUMN`
            (None: ``0, 1, ...``; a held-out mixture keeps its sets' ids).

    Example:
        >>> mixture = PromptMixture([PromptSet(read_table("math.parquet")),
        ...                          PromptSet(read_table("chat.jsonl"))], weights=[3, 1])
        >>> train, held_out = mixture.hold_out(8)  # 6 held-out math prompts, 2 chat ones
    """

    def __init__(self, sets: Sequence[PromptSet], weights: Sequence[float],
                 names: Sequence[str] | None = None, ids: Sequence[int] | None = None):
        if not sets or len(sets) != len(weights):
            raise ConfigError(f"A mixture needs one weight per prompt set: {len(sets)} sets, "
                              f"{len(weights)} weights.")
        self.sets, self.weights = list(sets), tuple(float(w) for w in weights)
        self.names = list(names) if names is not None else [s.table.name for s in self.sets]
        self.ids = list(ids) if ids is not None else list(range(len(self.sets)))
        for name, weight in zip(self.names, self.weights):
            if not weight > 0 or weight == float("inf"):
                raise ConfigError(f"The weight of {name} is {weight}: a weight is a finite number > 0.")
        self.offsets = list(itertools.accumulate([0] + self.sizes[:-1]))

    @property
    def sizes(self) -> list[int]:
        return [len(s) for s in self.sets]

    @property
    def longest(self) -> int | None:
        """The longest prompt's tokens over every set, once :meth:`check` has measured them."""
        lengths = [s.longest for s in self.sets]
        return None if None in lengths else max(lengths)

    def __len__(self) -> int:
        return sum(self.sizes)

    def __getitem__(self, i):
        if isinstance(i, slice):  # a few prompts (a probe): made now, in index order
            return [self[k] for k in range(len(self))[i]]
        if i < 0:
            i += len(self)
        s = bisect.bisect_right(self.offsets, i) - 1
        prompt = self.sets[s][i - self.offsets[s]]
        # each prompt names its source: per-source score normalisation reads it
        return replace(prompt, fields={**prompt.fields, SOURCE_COLUMN: self.ids[s]})

    def with_length_check(self, length_check) -> PromptMixture:
        return PromptMixture([s.with_length_check(length_check) for s in self.sets], self.weights,
                             self.names, self.ids)

    def check(self) -> int:
        """:meth:`PromptSet.check` of every set; returns how many prompts were cut."""
        return sum(s.check() for s in self.sets)

    def hold_out(self, k: int) -> tuple[PromptMixture, PromptMixture]:
        """``(training mixture, held-out prompts)``: ``k`` held-out prompts shared among the sets in
        proportion to their weights (:func:`apportion`), the last rows of each.

        Args:
            k: the number of held-out prompts.
        """
        shares = apportion(k, self.weights)
        for name, s, share in zip(self.names, self.sets, shares):
            if share >= len(s):
                raise ConfigError(f"{name} has {len(s)} prompts, {share} of them to be held out for "
                                  "evaluation (eval.num_prompts, shared by weight): add prompts, or "
                                  "lower eval.num_prompts.")
        train, held = zip(*(s.hold_out(share) for s, share in zip(self.sets, shares)))
        kept = [i for i, share in enumerate(shares) if share]  # (a mixture's sets are not empty)
        return (PromptMixture(train, self.weights, self.names, self.ids),
                PromptMixture([held[i] for i in kept], [self.weights[i] for i in kept],
                              [self.names[i] for i in kept], [self.ids[i] for i in kept]))


class MixtureBatchSampler(torch.utils.data.Sampler):
    """Global batches of ``batch_size`` indices into a :class:`PromptMixture` of sets of ``sizes``.

    Each slot's set is drawn with probability ``weight / sum(weights)`` (a generator seeded with
    ``seed``), and each set serves its rows in its own shuffled order (seeded with ``(seed, set)``;
    a new order each time it runs out, so a small set with a large weight repeats more often). The
    batches therefore depend on the seed and the batch index alone: the first ``skip`` global
    batches are drawn and dropped, and a resumed run serves exactly what the uninterrupted run
    served next. As :class:`~rlhf_torchrl.envs.prompt_env.ShardedBatchSampler`: every process draws
    the same global batches, process ``rank`` of ``world_size`` gets its contiguous
    ``batch_size / world_size`` slice, every index ``repeats`` times in a row (a group).

    Args:
        sizes: each set's number of rows.
        weights: each set's weight.
        batch_size: indices of a global batch (every process's together).
        rank: this process's rank.
        world_size: the number of processes.
        seed: the draws' and the shuffles' seed.
        skip: global batches drawn and dropped (a resumed run).
        repeats: times each index is yielded in a row (``samples_per_prompt``).

    Example:
        >>> sampler = MixtureBatchSampler([100, 10], [3.0, 1.0], batch_size=8, seed=0)
        >>> next(iter(sampler))  # 8 indices: ~6 from the first set (0-99), ~2 from the second
    """

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], batch_size: int, *,
                 rank: int = 0, world_size: int = 1, seed: int = 0, skip: int = 0, repeats: int = 1):
        self.sizes, self.batch_size, self.repeats = list(sizes), batch_size, repeats
        self.local = batch_size // world_size
        self.start = rank * self.local
        self.offsets = list(itertools.accumulate([0] + self.sizes[:-1]))
        self.probs = torch.tensor(weights, dtype=torch.float64)
        self.choice = torch.Generator().manual_seed(seed)
        self.orders = [_Order(n, int(np.random.SeedSequence([seed, s]).generate_state(1)[0]))
                       for s, n in enumerate(self.sizes)]
        self._skip = skip

    def __len__(self) -> int:
        """Batches in one pass: as many as the sets hold prompts (the draws go on across passes)."""
        return max(1, sum(self.sizes) // self.batch_size)

    def __iter__(self):
        for _ in range(len(self)):
            batch = self._draw()
            if self._skip:
                self._skip -= 1
                continue
            yield batch[self.start : self.start + self.local].repeat_interleave(self.repeats).tolist()

    def _draw(self) -> torch.Tensor:
        """The next global batch: (batch_size,) indices into the mixture."""
        source = torch.multinomial(self.probs, self.batch_size, replacement=True,
                                   generator=self.choice)  # (B,) the set of each slot
        batch = torch.empty(self.batch_size, dtype=torch.long)
        for s, order in enumerate(self.orders):
            slots = (source == s).nonzero().flatten()
            if len(slots):
                batch[slots] = self.offsets[s] + order.take(len(slots))
        return batch


class _Order:
    """The rows ``0..n-1`` of one set in shuffled order, a new order each pass (its own generator)."""

    def __init__(self, n: int, seed: int):
        self.n, self.generator = n, torch.Generator().manual_seed(seed)
        self.order, self.pos = torch.empty(0, dtype=torch.long), 0

    def take(self, k: int) -> torch.Tensor:
        """The next ``k`` rows of the order, starting a new pass where this one runs out."""
        out = []
        while k:
            if self.pos == len(self.order):
                self.order, self.pos = torch.randperm(self.n, generator=self.generator), 0
            m = min(k, len(self.order) - self.pos)
            out.append(self.order[self.pos : self.pos + m])
            self.pos, k = self.pos + m, k - m
        return torch.cat(out)


def load_prompts(
    source: str,
    *,
    split: str = "train",
    column: str = "prompt",
    template: str = "{prompt}",
    limit: int | None = None,
    max_words: int | None = None,
    system_prompt: str | None = None,
    config: str | None = None,
    generator_args: dict | None = None,
    seed: int = 0,
    check: bool | None = None,
):
    """Load prompts: a :class:`PromptSet`, each prompt made when read.

    Args:
        source: a file or dataset in any form :mod:`rlhf_torchrl.data.readers` reads, told by its path:
            ``.jsonl``, ``.json`` (an array of records), ``.parquet`` (a file, a folder or a glob
            of shards), ``.csv``/``.tsv``, a ``save_to_disk`` folder, a Hugging Face hub dataset
            (or a local folder in its layout); ``"polarity"`` (bundled review sentences) or
            ``"reasoning_gym:<name>"`` (a procedural task of the reasoning-gym package:
            ``question``, ``answer`` and ``metadata`` columns, checked by
            :func:`~rlhf_torchrl.rewards.functions.reasoning_gym_score`).
        split: dataset split (hub datasets, a saved DatasetDict).
        column: the field holding the prompt: text, an HH transcript, or a list of chat messages.
            Every other field of the row travels with the prompt (:attr:`~rlhf_torchrl.data.prompts.Prompt.fields`). Rows in
            verl's schema need none (:func:`verl_schema`).
        template: a format string applied to the last user message: ``{prompt}`` is that message,
            ``{name}`` the row's column ``name``, e.g.
            ``"TITLE: {title}\\n\\nPOST: {prompt}\\n\\nTL;DR:"`` with ``column="post"``.
        limit: keep the first ``limit`` prompts (reasoning-gym: generate that many, default 1000).
        max_words: keep only the first ``max_words`` words of the last user message (before
            templating), e.g. to turn review sentences into review openings to continue.
        system_prompt: a system message for conversations that have none (``None``: the chat
            template's default, if any).
        config: the HF dataset's configuration name (``"main"`` for ``openai/gsm8k``).
        generator_args: reasoning-gym: the task's settings (``{"max_terms": 2}``).
        seed: reasoning-gym: the seed its rows are generated from.
        check: make every prompt now, so that a bad row fails here (None: when the set has up to
            :data:`CHECK_ALL_UP_TO` prompts); otherwise a row is checked
            when it is read.
    """
    if "{prompt}" not in template:
        raise ConfigError(f"data.template must contain '{{prompt}}', got {template!r}.")
    table = read_table(source, split=split, config=config, limit=limit,
                       generator_args=generator_args, seed=seed)
    prompts = PromptSet(table, column="prompt" if source == POLARITY else column,
                        template=template, max_words=max_words, system_prompt=system_prompt,
                        limit=limit)
    if check if check is not None else len(prompts) <= CHECK_ALL_UP_TO:
        prompts.check()
    return prompts
