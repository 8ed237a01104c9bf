"""Every TensorDict key the library reads or writes, defined once.

A rollout is a TensorDict with ``batch_size=[B]`` (one row per prompt/response pair). Token-level
entries share the response width ``R``; prompts have their own width ``P``.

Reused from TorchRL's LLM vocabulary: ``("tokens", "prompt")``, ``("tokens", "response")``,
``("log_probs", "response")``, ``("text", ...)``, ``("next", "reward")``, ``("next", "done")``,
``"state_value"``, ``"advantage"``, ``"value_target"``.

:func:`require` checks that a rollout holds what a component reads: a missing key is one
:class:`~rlhf_torchrl.errors.ConfigError` line naming it and the step that writes it
(:func:`written_by`).
"""

from rlhf_torchrl.errors import ConfigError

# (B, P) int64, left-padded with the pad token.
PROMPT_TOKENS = ("tokens", "prompt")
# (B, P) bool, True on real prompt tokens.
PROMPT_MASK = ("masks", "prompt")
# The entries of prompt width P; every other (B, W, ...) tensor entry of a rollout has width R.
PROMPT_WIDTH = (PROMPT_TOKENS, PROMPT_MASK)
# (B, R) int64, right-padded: truncated after the first stop token, pad after it.
RESPONSE_TOKENS = ("tokens", "response")
# (B, R) bool, True on response tokens that count (the stop token included).
RESPONSE_MASK = ("masks", "response")
# (B,) bool, True where the response emitted the stop token.
HAS_STOP = ("masks", "has_stop_token")
# (B, R) bool, multi-turn episodes: True on the response-width tokens the environment wrote (tool
# results, the chat template's turn headers), which the policy reads but did not generate. The
# model attends to RESPONSE_MASK | OBSERVATION_MASK; PPO's loss, the KL, the entropy and GAE use
# RESPONSE_MASK alone. Absent (or all False) in single-response episodes.
OBSERVATION_MASK = ("masks", "observation")

# Decoded text, one string per row (non-tensor data). The prompt as the policy read it (chat
# template applied); the response without special tokens.
PROMPT_TEXT = ("text", "prompt")
RESPONSE_TEXT = ("text", "response")
# A multi-turn episode's whole transcript, tool messages included (for reading: the report's
# samples). RESPONSE_TEXT, which the rewards read, holds the policy's own turns alone.
EPISODE_TEXT = ("text", "episode")
# The conversation each prompt renders: a list of {"role", "content"} dicts per row (non-tensor),
# ending with the user turn the response answers.
PROMPT_MESSAGES = ("messages", "prompt")
# (B,) int64: the group of each row: rows with the same id are responses to the same prompt in
# the same batch (generation.samples_per_prompt). Group baselines (GRPO, RLOO) compare within it.
GROUP = "group"
# Dataset fields that travel with each prompt: ("data", <column>), one value per row (non-tensor).
DATA = "data"

# (B, R) float32: log-probs of the sampled tokens under the policy that sampled them (old policy).
LOG_PROB = ("log_probs", "response")
# (B, R) float32: the sampler's log-probs (the behaviour policy's), kept beside recomputed old
# log-probs: asynchronous collection and other engines sample with other weights or kernels.
BEHAVIOUR_LOG_PROB = ("log_probs", "behaviour")
# (B,) int64: the policy version (updates done) whose weights sampled each row (TorchRL's key).
POLICY_VERSION = "policy_version"
# (B,) float64, asynchronous collection: the seconds the sampler spent on the row's batch (the
# trainer waits for it only in part, so its own clock cannot give the sampling speed).
SAMPLING_SECONDS = "sampling_seconds"
# (B, R) int64, partial rollouts: the policy version that sampled each response token (a paused
# response is continued by newer weights; 0 on pads). POLICY_VERSION is then a row's oldest.
TOKEN_VERSION = ("policy_versions", "response")
# (B,) int64, partial rollouts: the rounds that sampled each response (1: never paused).
SEGMENTS = ("partial", "segments")
# (B, R) float32: the same tokens under the frozen reference model.
REF_LOG_PROB = ("ref_log_probs", "response")
# (B, R) float32, on-policy distillation: the same tokens under the teacher (its own model, the
# policy's vocabulary), at the sampling temperature, 0 on pads.
TEACHER_LOG_PROB = ("teacher_log_probs", "response")
# (B,) float32, on-policy distillation with reward.teacher_mapping=text (a teacher of another
# vocabulary): log p_teacher of the response's text, re-tokenised for the teacher (its stop token
# included where the response stopped), summed over its tokens.
TEACHER_SEQUENCE_LOG_PROB = ("teacher_log_probs", "sequence")
# (B, R) float32: the reverse-KL estimate to the teacher per token (a sequence-level estimate
# sits at the last response token); the reward gets -teacher_coef times it.
TEACHER_KL = ("teacher_kl", "response")
# (B, R) float32: per-token KL estimate between policy and reference.
KL = ("kl", "response")
# (B, R) float32: exact entropy of the sampling distribution at each response token.
ENTROPY = ("entropy", "response")

# (B, R) float32, multi-turn episodes: rewards the tools gave (a tool's outcome), each at the last
# token of the assistant turn that made the call; added to the per-token reward.
TURN_REWARD = "turn_reward"
# (B, R) float32, process rewards: a reward's value for each reasoning step at the step's last
# response token (weighted and summed over the rewards that give values per step); added to the
# per-token reward, and kept out of SCORE.
STEP_REWARD = "step_reward"
# (B,) int64, multi-turn episodes: assistant turns, tool calls made, tool calls that failed (an
# error or a timeout), and why the episode ended (an index into
# rlhf_torchrl.data.rollout.END_REASONS).
TURNS = ("episode", "turns")
TOOL_CALLS = ("episode", "tool_calls")
TOOL_ERRORS = ("episode", "tool_errors")
EPISODE_END = ("episode", "end")
# (B,) float32: combined sequence-level score (reward model and/or reward functions, EOS penalty).
SCORE = "score"
# (B,) float32: score before the missing-EOS penalty and any whitening/clipping.
RAW_SCORE = "raw_score"
# (B,) float32: the response's reward without its KL part, summed over its tokens: the score as
# the shaper whitened and clipped it, plus a multi-turn episode's turn rewards. What the group
# baselines and the group filter compare (written once, not recovered by subtracting the KL).
SHAPED_SCORE = "shaped_score"
# sub-keys (B,) float32: per-row statistics a reward writes for logging, each logged as
# reward/<sub-key>, its mean over the batch (e.g. a judge's "judge_parse_fail_frac").
REWARD_STATS = "reward_stats"

# (B, R, 1) float32: per-token reward -kl_coef * KL[t] (+ score at the last response token).
REWARD = ("next", "reward")
# (B, R, 1) float32: the KL part of the reward alone, -kl_coef * KL[t] (with a teacher, plus
# -teacher_coef * TEACHER_KL[t]).
NON_SCORE_REWARD = ("next", "non_score_reward")
# (B, R, 1) bool: True at the last valid response token.
DONE = ("next", "done")
TERMINATED = ("next", "terminated")

# (B, R, 1) float32: critic values V(s_t) at each response token (old values during the update).
VALUE = "state_value"
# (B, R, 1) float32: GAE advantages (whitened over valid tokens) and returns = advantages + values.
ADVANTAGE = "advantage"
VALUE_TARGET = "value_target"
# (B,) float64, written into each minibatch before it is split (TokenPPOLoss.prepare_minibatch):
# each response's weight in the positive-example NLL term (functional.positive_nll_weights).
POSITIVE_NLL_WEIGHT = "positive_nll_weight"
# (B, R) bool, written into each minibatch before it is split by the covariance entropy controls
# (objectives.policy_losses.clip_cov and kl_cov): the tokens they act on.
COV_SELECTED = "cov_selected"

# (B, R) int64, token_view's steps only (rlhf_torchrl.data.trajectory): the response position each
# time step of the view comes from (its policy tokens in order, then the other positions).
TOKEN_POSITION = "token_position"


def written_by(key) -> str:
    """The pipeline step that writes ``key`` into a rollout (for errors about a missing key).

    Args:
        key (str | tuple[str, ...]): a rollout entry, e.g. ``("log_probs", "response")``.
    """
    collector = "the collector (RolloutCollector, to_rollout)"
    text = "the collector (RolloutCollector, to_rollout with a tokenizer)"
    shaper = "the reward shaper (KLRewardShaper, after the Scorer)"
    steps = {
        PROMPT_TOKENS: collector, PROMPT_MASK: collector, RESPONSE_TOKENS: collector,
        RESPONSE_MASK: collector, HAS_STOP: collector, PROMPT_TEXT: text, RESPONSE_TEXT: text,
        GROUP: "the collector (RolloutCollector, samples_per_prompt)",
        LOG_PROB: "the sampler (make_generation_policy(record_log_probs=True)) or "
                  "compute_old_quantities(actor=...)",
        REF_LOG_PROB: "the reference pass (compute_old_quantities(reference=...))",
        TEACHER_LOG_PROB: "the teacher's pass (rlhf_torchrl.rewards.distillation.TeacherLogProbs)",
        TEACHER_SEQUENCE_LOG_PROB: "the teacher's pass on the text "
                                   "(rlhf_torchrl.rewards.distillation.TextTeacherLogProbs)",
        BEHAVIOUR_LOG_PROB: "the trainer, which keeps the sampler's log-probs there before "
                            "recomputing the old ones (PPOTrainer(keep_sampler_log_probs=True)); "
                            "a loss with tis_cap weighs each token by their ratio",
        VALUE: "the critic's pass (compute_old_quantities(critic=...))",
        SCORE: "the scorer (Scorer)",
        STEP_REWARD: "the scorer (Scorer(steps=StepRewards(tokenizer)), a reward that returns "
                     "values per step)",
        KL: shaper, REWARD: shaper, NON_SCORE_REWARD: shaper, DONE: shaper, TERMINATED: shaper,
        SHAPED_SCORE: shaper, TEACHER_KL: shaper,
        ADVANTAGE: "the advantage estimator (ResponseGAE, make_advantage)",
        VALUE_TARGET: "the critic's estimator (ResponseGAE; the critic-free ones write none)",
    }
    return steps.get(key, "an earlier step")


def require(td, *keys, what: str) -> None:
    """Raise a one-line :class:`~rlhf_torchrl.errors.ConfigError` for the first of ``keys`` that
    ``td`` lacks, naming the key, ``what`` reads it and the step that writes it.

    Args:
        td (tensordict.TensorDictBase): the rollout (or minibatch) to check.
        *keys: the entries ``what`` reads.
        what: the reader, named in the error (e.g. ``"ResponseGAE"``).
    """
    present = td.keys(True, True)
    for key in keys:
        if key not in present:
            raise ConfigError(f"{what} reads {key!r}, which this rollout does not have: it is "
                              f"written by {written_by(key)}; run that step first.")
