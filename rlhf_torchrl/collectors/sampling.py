"""Token sampling for Hugging Face ``generate``: exact, fast on CPU, and recording log-probs.

``torch.multinomial`` (what ``generate(do_sample=True)`` calls) draws one exponential random
number per vocabulary entry per row on CPU; for a 49k vocabulary that is most of a small model's
generation time. Inverse-CDF sampling needs two uniforms per row. :class:`InverseCDFSampler` is a
``LogitsProcessor`` that draws the token itself and hands ``generate`` a score row that is ``-inf``
everywhere but the chosen token, so greedy decoding (``do_sample=False``) emits the sample.

Because it sees the temperature-scaled logits of every step, it also records the sampled tokens'
log-probs (and, optionally, the exact entropies): PPO's "old" log-probs come out of generation
without another forward pass of the policy. With a critic on the policy's own trunk,
:class:`ValueRecorder` reads the old values off the same pass.

On-policy sampling needs more than a correct sampler: ``generate`` fills every setting it is not
given from the checkpoint's ``generation_config`` (instruct checkpoints ship repetition penalties,
suppressed tokens, minimum lengths), and those logits processors run before the sampler.
:func:`sampling_generation_config` builds the config generation runs under from the recipe's
settings alone, :func:`ignored_generation_settings` names what it leaves out, and
:func:`~rlhf_torchrl.collectors.on_policy.check_on_policy` compares recorded log-probs with the training
forward's.
"""

from __future__ import annotations

import functools
import logging
import threading
from contextlib import contextmanager

import torch

from rlhf_torchrl.errors import ConfigError

log = logging.getLogger(__name__)

_BLOCK = 256
_STEPS_PER_DRAW = 64  # per-row uniforms are drawn for this many steps at a time
# generation_config entries that do not change which token is drawn
_NEUTRAL_FIELDS = {"bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id",
                   "transformers_version", "_from_model_config", "use_cache", "cache_implementation",
                   "return_dict_in_generate", "output_scores", "output_logits", "output_attentions",
                   "output_hidden_states"}


def sample_inverse_cdf(
    weights: torch.Tensor,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row-wise draws ``i ~ weights[b, i] / weights[b].sum()`` by inverse CDF, exact to fp64.

    A flat fp32 cumulative sum over a large vocabulary would round every entry below ``2**-24`` of
    the running total to zero probability; instead the vocabulary is cut into blocks of 256, a block
    is drawn from the block masses (cumulated in fp64), then a token from inside that block (fp64
    cumulative sum of 256 entries). A zero weight is never drawn. Returns (B,) int64 indices.

    Args:
        weights: (B, V) non-negative, unnormalised weights, each row with a positive sum.
        generator: draws the two uniforms per row (None: torch's global generator).
        uniforms: (B, 2) the uniforms, in (0, 1], given instead (per-row random streams,
            :class:`InverseCDFSampler`).
    """
    n_rows, n = weights.shape
    if uniforms is None:
        uniforms = 1.0 - torch.rand(n_rows, 2, dtype=torch.float64, device=weights.device,
                                    generator=generator)
    pad = (-n) % _BLOCK
    blocks = (torch.nn.functional.pad(weights, (0, pad)) if pad else weights).view(n_rows, -1, _BLOCK)
    block = _draw(blocks.sum(-1).double(), uniforms[:, :1])  # (B,)
    inside = blocks[torch.arange(n_rows, device=weights.device), block].double()  # (B, 256)
    return block * _BLOCK + _draw(inside, uniforms[:, 1:])


def _draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index of the first cumulative weight reaching ``u * total``, with ``u`` (B, 1) in (0, 1].

    ``u > 0``: the returned entry raised the cumulative sum, so its weight is positive; ``u <= 1``:
    the sum's last entry is always reached, so no index runs past the end.
    """
    cdf = weights.cumsum(-1)
    return torch.searchsorted(cdf, u.to(cdf.dtype) * cdf[:, -1:]).squeeze(1)


def row_stream_seeds(seed: int, batch: int, rows: range | list[int], turn: int = 0,
                     segment: int = 0) -> list[int]:
    """One 63-bit seed per prompt row, from (run seed, batch index, global row index) and, after a
    multi-turn episode's first turn, the turn; after a partial rollout's first segment (a paused
    response continued, :mod:`~rlhf_torchrl.collectors.partial`), the segment.

    The random stream a row's tokens are drawn with then depends on which prompt of which batch it
    is, never on which process drew it or which rows share its batch: a run is world-size invariant.

    Args:
        seed: the run's sampling seed.
        batch: the global batch's index.
        rows: the rows' global indices.
        turn: the turn of a multi-turn episode (0: the first).
        segment: the segment of a partial rollout (0: the first).
    """
    import numpy as np

    later_turn = [turn] if turn else []  # turn 0 keeps the single-response streams
    # segment 0 keeps them too; a later one is a fifth word (SeedSequence ignores trailing zeros)
    later_segment = [turn, segment] if segment else []
    return [int(np.random.SeedSequence([seed, batch, row, *(later_segment or later_turn)])
                .generate_state(2, np.uint64)[0] >> 1) for row in rows]


class InverseCDFSampler:
    """A ``LogitsProcessor`` that samples with temperature, top-k and top-p, for greedy ``generate``.

    Use with ``do_sample=False`` and no other sampling warpers (this one applies them)::

        sampler = InverseCDFSampler(temperature=0.7)
        out = model.generate(**inputs, do_sample=False, logits_processor=[sampler])
        log_probs = sampler.pop()[0]  # (B, T) log-probs of the generated tokens

    :meth:`pop` returns the records stacked as (B, T) fp32 and clears them. Rows that already
    finished keep being recorded: the caller masks them. After :meth:`set_streams`, random numbers
    come from one stream per row (seeded by :func:`row_stream_seeds`): then a row's tokens do not
    depend on the other rows of its batch.

    Args:
        temperature: the sampling temperature.
        top_k: keep the ``k`` likeliest tokens (0: all).
        top_p: nucleus sampling's mass (1.0: all).
        record: keep each step's sampled-token log-probs under the distribution they were drawn
            from (temperature-scaled; renormalised over the tokens top-k/top-p leave, when set).
        record_entropy: keep the exact entropies of those distributions too.
        generator: the random numbers' source (None: torch's global generator).
    """

    def __init__(
        self,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        *,
        record: bool = True,
        record_entropy: bool = False,
        generator: torch.Generator | None = None,
    ):
        if temperature <= 0:
            raise ConfigError(f"temperature must be > 0, got {temperature}.")
        if not 0 < top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {top_p}.")
        if top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = off), got {top_k}.")
        from transformers import TopKLogitsWarper, TopPLogitsWarper

        self.temperature = temperature
        self.truncate = []
        if top_k:
            self.truncate.append(TopKLogitsWarper(top_k))
        if top_p < 1:
            self.truncate.append(TopPLogitsWarper(top_p))
        self.record = record
        self.record_entropy = record_entropy
        self.generator = generator
        self._stream_seeds: list[int] | None = None
        self._streams: list[torch.Generator] | None = None
        self._drawn: torch.Tensor | None = None  # (B, steps, 2) uniforms drawn ahead
        self._next_step = 0
        self._log_probs: list[torch.Tensor] = []
        self._entropies: list[torch.Tensor] = []

    def set_streams(self, seeds: list[int] | None) -> None:
        """Draw row ``i`` of the next generation from its own generator seeded with ``seeds[i]``
        (None: back to the shared ``generator``).

        Args:
            seeds: one seed per row (None: the shared ``generator``).
        """
        self._stream_seeds = None if seeds is None else list(seeds)
        self._streams = self._drawn = None

    def _uniforms(self, n_rows: int, device: torch.device) -> torch.Tensor | None:
        """(B, 2) fp64 uniforms in (0, 1], one pair per row from its stream; None without streams.

        Each row's stream is drawn ``_STEPS_PER_DRAW`` steps ahead in one call (B calls per 64
        steps instead of B per step). A CPU generator fills a tensor serially, so the pairs are
        those of one ``rand(2)`` per step: the same tokens either way."""
        if self._stream_seeds is None:
            return None
        if len(self._stream_seeds) != n_rows:
            raise ValueError(f"The sampler has {len(self._stream_seeds)} row streams for a batch "
                             f"of {n_rows} rows: call set_streams with one seed per row.")
        if self._streams is None or self._streams[0].device != device:
            self._streams = [torch.Generator(device).manual_seed(s) for s in self._stream_seeds]
            self._drawn = None
        if self._drawn is None or self._next_step == self._drawn.shape[1]:
            self._drawn = torch.stack([
                torch.rand(_STEPS_PER_DRAW, 2, dtype=torch.float64, device=device, generator=g)
                for g in self._streams])
            self._next_step = 0
        self._next_step += 1
        return 1.0 - self._drawn[:, self._next_step - 1]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logits = scores.float() / self.temperature  # (B, V)
        shifted = logits - logits.amax(-1, keepdim=True)
        weights = shifted.exp()
        total = weights.sum(-1)
        if not torch.isfinite(total).all():
            raise FloatingPointError(
                "The policy produced NaN or infinite logits while sampling: its weights have "
                "diverged (lower optim.lr or raise ppo.kl_coef, and check the previous iterations' "
                "grad_norm and objective/kl)."
            )
        if self.truncate:
            kept = logits
            for warper in self.truncate:
                kept = warper(input_ids, kept)
            weights_kept = weights.masked_fill(kept == float("-inf"), 0.0)
        else:
            weights_kept = weights
        tokens = sample_inverse_cdf(weights_kept, self.generator,
                                    self._uniforms(weights.shape[0], weights.device))
        if self.record:
            # the distribution the token was drawn from: the truncated one where top-k/top-p cut it
            # (PPO's loss computes the full one: the on-policy check then fails, as it should)
            kept_total = weights_kept.sum(-1) if self.truncate else total
            log_norm = kept_total.log()  # logsumexp(shifted) over the tokens that could be drawn
            self._log_probs.append(shifted.gather(1, tokens[:, None]).squeeze(1) - log_norm)
            if self.record_entropy:
                kept_shifted = shifted.masked_fill(weights_kept == 0, 0.0)
                mean_shifted = (weights_kept * kept_shifted).sum(-1) / kept_total
                self._entropies.append(log_norm - mean_shifted)
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens[:, None], 0.0)

    def pop(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(log_probs, entropies) of the steps recorded since the last call, (B, T) each or None."""
        log_probs = torch.stack(self._log_probs, 1) if self._log_probs else None
        entropies = torch.stack(self._entropies, 1) if self._entropies else None
        self._log_probs, self._entropies = [], []
        return log_probs, entropies


class ValueRecorder:
    """A shared-trunk critic's values, read off the sampling pass.

    Decoding already runs the policy's trunk on the state before every response token: the last
    prompt token at the first step, then each sampled token. While :meth:`recording` is on, a
    forward hook on ``trunk`` applies the value ``head`` to the hidden state of the last position
    of each forward: ``V(s_t)`` for response token ``t``, the state
    :class:`~rlhf_torchrl.modules.TokenCritic` reads at position ``P - 1 + t``. The old values
    then cost one linear layer per step instead of a trunk forward over the whole batch.

    The head runs outside autocast, in its own dtype, and the values are kept as fp32. Only
    forwards of the thread that started the recording count (an evaluation that runs the same
    model meanwhile does not). :meth:`pop` returns the values since the last call, (B, T) fp32.
    Rows that already finished keep being recorded: the caller masks them.

    Args:
        trunk: the policy's trunk, whose forwards are hooked.
        head: the critic's value head.
    """

    def __init__(self, trunk: torch.nn.Module, head: torch.nn.Module):
        self.trunk, self.head = trunk, head
        self._values: list[torch.Tensor] = []
        self._thread: int | None = None

    @contextmanager
    def recording(self):
        """Record the values of every trunk forward this thread runs inside the block."""
        handle = self.trunk.register_forward_hook(self._hook)
        self._thread = threading.get_ident()
        try:
            yield
        finally:
            handle.remove()
            self._thread = None

    def wrap(self, generate):
        """``generate``, recording while it runs.

        Args:
            generate (Callable): a ``generate`` function.
        """

        @functools.wraps(generate)
        def recording_generate(*args, **kwargs):
            with self.recording():
                return generate(*args, **kwargs)

        return recording_generate

    def _hook(self, module, args, output) -> None:
        if threading.get_ident() != self._thread:
            return
        hidden = output[0][:, -1]  # (B, H): last_hidden_state (a ModelOutput or a tuple)
        with torch.autocast(hidden.device.type, enabled=False), torch.no_grad():
            values = self.head(hidden.to(self.head.weight.dtype)).squeeze(-1)
        self._values.append(values.float())

    def pop(self) -> torch.Tensor | None:
        """(B, T) fp32 values recorded since the last call (None if none) and clears them."""
        values = torch.stack(self._values, 1) if self._values else None
        self._values = []
        return values


def ignored_generation_settings(generation_config) -> dict:
    """The entries of a checkpoint's ``generation_config`` that would change sampling.

    Everything that differs from transformers' defaults, except token ids and output switches:
    ``do_sample``, ``temperature``, ``top_k``/``top_p``, ``repetition_penalty``,
    ``no_repeat_ngram_size``, ``min_new_tokens``, ``suppress_tokens``, ``bad_words_ids``, ...

    Args:
        generation_config (transformers.GenerationConfig): a checkpoint's generation config.
    """
    if generation_config is None:
        return {}
    return {k: v for k, v in generation_config.to_diff_dict().items() if k not in _NEUTRAL_FIELDS}


def sampling_generation_config(model):
    """The ``GenerationConfig`` that stands in for the checkpoint's own while a response is generated.

    ``generate`` fills every setting it is not passed from ``model.generation_config``; with this
    config in its place (see :class:`~rlhf_torchrl.collectors.RolloutCollector`) the unset ones
    fall back to transformers' neutral defaults (no penalty, no suppressed token, no minimum
    length, greedy over :class:`InverseCDFSampler`'s one-hot scores), and the recipe's settings
    come only from the ``generate`` arguments. The model's BOS id is kept (for empty inputs).

    Args:
        model (transformers.PreTrainedModel): the policy model (its BOS id is kept).
    """
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=getattr(model.generation_config, "bos_token_id", None))


def warn_ignored_generation_settings(model, temperature: float) -> dict:
    """Log (once per call) which of the checkpoint's generation settings sampling leaves out.

    Args:
        model (transformers.PreTrainedModel): the policy model.
        temperature: the sampling temperature the recipe sets, named in the message.
    """
    ignored = ignored_generation_settings(getattr(model, "generation_config", None))
    if ignored:
        settings = ", ".join(f"{k}={v!r}" for k, v in sorted(ignored.items()))
        log.warning(
            "Ignoring the checkpoint's generation_config for sampling: %s. PPO needs responses drawn "
            "from the distribution its loss computes, so they are sampled from the policy's full "
            "distribution at temperature %s (generation.temperature/top_k/top_p are the only "
            "sampling settings).", settings, temperature,
        )
    return ignored


def check_full_distribution(top_k: int, top_p: float, *, where: str = "") -> None:
    """Refuse top-k/top-p truncation for the responses PPO trains on.

    PPO's ratio, the KL to the reference and the on-policy check are taken under the policy's
    full temperature-scaled distribution. Tokens drawn from a truncated one came from another
    policy: the first ratio would not be 1, and a token the truncation could never draw under
    the updated policy has no finite log-ratio. So training samples from the full distribution
    (as TRL's PPO and the N+ implementation details pin ``top_k=0, top_p=1.0``); the temperature
    is the one sampling setting both sides follow.

    Args:
        top_k: must be 0.
        top_p: must be 1.0.
        where: prefixes the setting names in the error (``"generation."`` for the recipe's).
    """
    if top_k or top_p < 1:
        raise ConfigError(
            f"{where}top_k={top_k} / {where}top_p={top_p}: PPO's ratio and KL use the policy's full "
            "distribution, so responses drawn from a truncated one are off-policy; train with "
            f"{where}top_k=0 and {where}top_p=1.0 (the temperature is the sampling setting PPO follows).")
