"""PPOTrainer: the PPO-RLHF iteration over TorchRL components; everything else hangs on hooks.

The loop (:meth:`PPOTrainer.fit`) is the algorithm box: collect, score, old quantities, KL-shaped
rewards, advantages, PPO epochs, log. Evaluation, checkpoints, guards, weight pushes, thread tuning,
metrics and the report are hooks (:mod:`rlhf_torchrl.trainers.hooks`) registered at named stages, as in
``torchrl.trainers.Trainer``. A user builds the trainer in Python from any components, swaps one,
or registers a hook::

    trainer = PPOTrainer(collector=..., scorer=..., actor=..., reference=..., critic=...,
                         shaper=..., advantage=..., loss_module=..., optimizer=...,
                         num_iterations=100, pad_token_id=tokenizer.pad_token_id)
    trainer.register_op("post_steps_log", lambda batch: {"my/len": float(batch["masks", "response"].sum())})
    trainer.fit()

``rlhf_torchrl.config.builders.build_trainer(cfg)`` builds it from the Hydra config.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext

import torch
from tensordict import TensorDictBase
from torch import nn

from rlhf_torchrl import keys as K
from rlhf_torchrl.distributed import DataParallel, PeerLost, lost_peer
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.modules import compute_old_quantities
from rlhf_torchrl.objectives.advantages import (
    compares_groups,
    group_metrics,
    informative_groups,
    on_token_view,
)
from rlhf_torchrl.objectives.loss_inputs import check_replay_buffer, use_rollout_keys
from rlhf_torchrl.record.metrics import rollout_metrics, sampler_metrics
from rlhf_torchrl.runtime import module_device, placed
from rlhf_torchrl.trainers.checkpoint import (
    load_checkpoint,
    load_rng_state,
    load_rollouts,
    rng_state,
    set_rng_state,
)
from rlhf_torchrl.trainers.guards import NonFiniteError, check_finite
from rlhf_torchrl.trainers.interrupt import InterruptHandler, RunInterrupted, signal_name
from rlhf_torchrl.trainers.optim import CriticWarmup
from rlhf_torchrl.trainers.stages import StagedLoop
from rlhf_torchrl.trainers.update import UpdateSettings, ppo_update

log = logging.getLogger(__name__)

#: seconds an error waits for the collector's shutdown (its sampling thread, engine, Ray workers)
#: before it is raised; the shutdown goes on in the background past that
SHUTDOWN_AFTER_ERROR_S = 10.0


class PPOTrainer(StagedLoop):
    """PPO over a rollout TensorDict, one method per phase; with a token-level critic (GAE) or
    a critic-free advantage estimator (GRPO, RLOO, REINFORCE++).

    Every component is swappable; everything that is not the algorithm hangs on hooks
    (:meth:`register_hook`, :meth:`register_op`).

    Args:
        collector (Iterable | Callable): an iterable of rollouts, or a callable
            ``(start_batch, pending) -> collector`` that :meth:`fit` calls, so that a resumed
            run's collector starts where the checkpoint stopped.
        scorer (nn.Module): writes ``"score"`` (:class:`~rlhf_torchrl.rewards.scoring.Scorer`).
        actor (nn.Module): the policy's token-level log-probs
            (:class:`~rlhf_torchrl.modules.TokenLevelActor`).
        reference (nn.Module): the frozen reference's, written as ``("ref_log_probs", "response")``.
        critic (nn.Module | None): a :class:`~rlhf_torchrl.modules.TokenCritic`, or None with a
            critic-free estimator.
        shaper (nn.Module): per-token KL rewards; owns the KL coefficient
            (:class:`~rlhf_torchrl.objectives.kl_shaping.KLRewardShaper`).
        advantage (nn.Module): a TensorDict module writing ``"advantage"``, and ``"value_target"``
            for a critic (:mod:`~rlhf_torchrl.objectives.advantages`).
        loss_module (nn.Module): a TorchRL ``ClipPPOLoss``, given the rollout's keys and mask here
            if it has TorchRL's (:func:`~rlhf_torchrl.objectives.loss_inputs.use_rollout_keys`).
        optimizer (torch.optim.Optimizer): steps the policy and the critic.
        num_iterations (int): iterations (rollout + update) :meth:`fit` runs, in all.
        pad_token_id (int): the tokenizer's pad id, for the update's batches.
        replay_buffer (torchrl.data.ReplayBuffer | None): the minibatch sampler
            (:func:`~rlhf_torchrl.trainers.update.make_minibatch_buffer`, with a seed of its own);
            None: one per update, shuffled by torch's global generator.
        update (UpdateSettings): how the update passes over each rollout: PPO epochs,
            minibatches, micro-batches, gradient clip, critic-only passes
            (:class:`~rlhf_torchrl.trainers.update.UpdateSettings`, :func:`~rlhf_torchrl.trainers.update.ppo_update`;
            None: its defaults).
        forward_batch_size (int): rows per no-grad forward (old and reference log-probs, values).
        scheduler (torch.optim.lr_scheduler.LRScheduler | None): stepped after each optimiser step
            (:func:`~rlhf_torchrl.trainers.optim.make_optimizer`).
        grad_scaler (torch.amp.GradScaler | None): fp16 autocast's loss scaler.
        parallel (DataParallel | None): this process's place in a torchrun job; None: one process.
        recompute_log_probs (bool): old log-probs from a training forward (vLLM, bf16) instead
            of those recorded while sampling.
        keep_sampler_log_probs (bool): keep the recorded ones beside them (truncated importance
            sampling, ``policy/behaviour_approxkl``).
        exact_entropy (bool): ``objective/entropy`` from the softmax over the vocabulary, or the
            sample estimate ``-log p``.
        offload_reference (bool): the reference visits the device only while it runs.
        critic_warmup (int | CriticWarmup): the first N iterations train the critic alone (the
            optimiser's schedule holds the policy: :func:`~rlhf_torchrl.trainers.optim.make_optimizer`'s
            ``critic_warmup_steps``), or a :class:`~rlhf_torchrl.trainers.optim.CriticWarmup` that ends
            when the critic's fit stops improving.
        on_non_finite (Callable | None): ``(error, iteration, batch)``, called on a NaN/inf: it
            raises to stop, returns to skip the iteration (no further optimiser step); None: the
            error propagates.
        filter_groups (bool): drop the groups of responses whose scores are all equal before the
            advantages (DAPO's dynamic filtering, with a group estimator and no critic; logged as
            ``group/filtered_frac``).
        reward_transform (Callable | None): applied to each scored rollout before the old
            quantities: a TorchRL ``Transform`` or any TensorDict -> TensorDict callable that
            reshapes ``"score"`` (a length penalty, a format bonus; ``examples/reward_transform.py``;
            :mod:`rlhf_torchrl.rewards.length`); a module's ``state_dict`` is checkpointed.
        teacher (nn.Module | None): on-policy distillation: writes the teacher's log-probs with
            the old quantities (:class:`~rlhf_torchrl.rewards.distillation.TeacherLogProbs`, or
            :class:`~rlhf_torchrl.rewards.distillation.TextTeacherLogProbs`), which the shaper
            turns into minus the reverse KL to the teacher per token; None: no teacher.

    Where TorchRL's ``Trainer`` does not fit, and why: an iteration is one rollout of whole
    responses, not a frame count; minibatches are split into token-weighted micro-batches
    (:func:`~rlhf_torchrl.trainers.update.ppo_update`), each process runs its slice of every minibatch
    and the gradients are averaged over all processes' tokens; a non-finite value skips (or stops)
    the iteration before any optimiser step; checkpoints are sharded
    (:mod:`rlhf_torchrl.trainers.checkpoint`). The stage names are TorchRL's where they fit (:data:`~rlhf_torchrl.trainers.stages.STAGES`).

    ``state_dict()`` holds everything an exact resume needs besides the weights, the optimiser and
    the rollouts sampled ahead (which :meth:`load_checkpoint` restores too, each process its own):
    iterations done, scheduler, gradient scaler, KL coefficient, minibatch shuffle, RNG states,
    each registered hook's state, and a reward transform's (a module's ``state_dict``: the running
    per-source score statistics of :class:`~rlhf_torchrl.rewards.length.PerSourceScoreNorm`). The RNG states (each process's own, from a checkpoint) are set
    when :meth:`fit` starts, after the collector is built: building it may draw random numbers.
    """

    def __init__(
        self,
        *,
        collector: Iterable | Callable,
        scorer: nn.Module,
        actor: nn.Module,
        reference: nn.Module,
        critic: nn.Module | None,
        shaper: nn.Module,
        advantage: nn.Module,
        loss_module: nn.Module,
        optimizer: torch.optim.Optimizer,
        num_iterations: int,
        pad_token_id: int,
        replay_buffer=None,
        update: UpdateSettings | None = None,
        forward_batch_size: int = 16,
        scheduler=None,
        grad_scaler=None,
        parallel: DataParallel | None = None,
        recompute_log_probs: bool = False,
        keep_sampler_log_probs: bool = False,
        exact_entropy: bool = True,
        offload_reference: bool = False,
        critic_warmup: int | CriticWarmup = 0,
        on_non_finite: Callable | None = None,
        filter_groups: bool = False,
        reward_transform: Callable | None = None,
        teacher: nn.Module | None = None,
    ):
        super().__init__()
        self.collector = collector
        self.scorer, self.actor, self.reference, self.critic = scorer, actor, reference, critic
        wrapped = on_token_view(advantage)
        if wrapped is not None:  # TorchRL's own estimator: it runs on the token layout
            log.warning("PPOTrainer: %s runs on token_view(rollout), TorchRL's trajectory layout "
                        "(OnTokenView): the rollout holds one row per response.",
                        type(advantage).__name__)
            advantage = wrapped
        self.shaper, self.advantage, self.loss_module = shaper, advantage, loss_module
        self.optimizer, self.scheduler, self.grad_scaler = optimizer, scheduler, grad_scaler
        self.replay_buffer, self.pad_token_id = replay_buffer, pad_token_id
        self.parallel = parallel if parallel is not None else DataParallel()
        self.num_iterations, self.update = num_iterations, update or UpdateSettings()
        self.forward_batch_size, self.exact_entropy = forward_batch_size, exact_entropy
        # old log-probs from a training forward (vLLM, bf16) instead of those recorded while sampling;
        # keep_sampler_log_probs keeps the recorded ones beside them (TIS, the mismatch metric)
        self.recompute_log_probs, self.keep_sampler_log_probs = recompute_log_probs, keep_sampler_log_probs
        self.offload_reference = offload_reference
        # the critic trains alone first: N iterations, or a CriticWarmup that ends on its own
        self.critic_warmup = (critic_warmup if isinstance(critic_warmup, CriticWarmup)
                              else CriticWarmup(critic_warmup))
        if self.critic_warmup.until is not None and scheduler is None:
            raise ConfigError("A CriticWarmup with `until` holds the policy through the learning-"
                              "rate schedule: pass the scheduler of make_optimizer(..., "
                              "critic_warmup_steps=warmup.frozen_steps).")
        # what a NaN/inf does: on_non_finite(error, iteration, batch) raises (stop) or returns
        # (skip: no further optimiser step this iteration); None: the NonFiniteError propagates
        self.on_non_finite = on_non_finite
        if filter_groups and (critic is not None or not compares_groups(advantage)):
            with_critic = " with a critic" if critic is not None else ""
            raise ConfigError(
                f"filter_groups drops the groups whose scores are all equal, which lack a signal "
                f"only under a group baseline: give a group estimator (GRPOAdvantage, "
                f"RLOOAdvantage: 'group' in its in_keys) and no critic, not "
                f"{type(advantage).__name__}{with_critic}.")
        self.filter_groups = filter_groups
        # before any work: a plain ClipPPOLoss gets the rollout's keys and mask (or is refused)
        use_rollout_keys(loss_module, where="PPOTrainer")
        if replay_buffer is not None:
            check_replay_buffer(replay_buffer, filtered=filter_groups)
        self.reward_transform = reward_transform
        self.teacher = teacher  # on-policy distillation: the teacher's log-probs (None: none)
        self.iteration = 0  # the iteration running, 0 first (between iterations: those done)
        self.updated = False  # whether its update has run (iterations_done counts it from then)
        self.interrupt: InterruptHandler | None = None  # while fit() runs
        self.stopping = 0  # a stop signal's number, agreed by every process at an iteration's end
        self.first_iteration = 0  # where this process started (a resumed run: the checkpoint's)
        self.pending: list = []  # rollouts sampled ahead, restored from a checkpoint
        self.restored_rng: Mapping | None = None  # a checkpoint's RNG states, set when fit() starts
        self.report: dict = {}  # the run's summary, filled by the RunLog hook at the end

    @property
    def iterations_done(self) -> int:
        """Iterations finished, the running one included once its update has run (its
        ``post_steps``, ``post_steps_log``, ``checkpoint`` and ``log`` stages see it done): what a
        checkpoint records, the weights' version."""
        return self.iteration + int(self.updated)

    # ---- the loop -------------------------------------------------------------------------------
    def fit(self) -> dict:
        """Run the iterations left (all, or those after the loaded checkpoint); returns the
        report (``self.report``)."""
        if callable(self.collector) and not hasattr(self.collector, "__iter__"):
            self.collector = self.collector(self.iteration, self.pending)
        elif self.pending:
            raise ConfigError(f"The checkpoint holds {len(self.pending)} batches sampled ahead, "
                              "which a collector built in advance cannot serve: pass a collector "
                              "factory (start_batch, pending) -> collector.")
        elif self.iteration:
            log.warning("Resumed at iteration %d with a collector built in advance: it must start "
                        "at that batch (pass a collector factory to be sure).", self.iteration)
        if hasattr(self.collector, "update_weights") and "weight_push" not in self.hooks:
            from rlhf_torchrl.trainers.hooks import (
                WeightPush,  # a sampler with weights of its own waits for them
            )

            self.register_hook("weight_push", WeightPush())
        where = lambda: f"iteration {self.iteration + 1} of {self.num_iterations}"  # noqa: E731
        try:
            self.run_stage("setup")
            rollouts = iter(self.collector)
            if self.restored_rng is not None:
                # after the collector and the hooks' setup, which may draw random numbers: the
                # first iteration starts from the states the checkpointed run had at that point
                set_rng_state(self.restored_rng)
                self.restored_rng = None
            with InterruptHandler(where) as self.interrupt:
                try:
                    self._iterate(rollouts)
                except RuntimeError as error:
                    line = lost_peer(error)
                    if line is None:
                        raise
                    # torchrun's SIGTERM to this process follows within a tenth of a second: held
                    # back (delivered when the command has said why, or at exit), the line is said
                    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
                    raise PeerLost(line) from error
        except RunInterrupted as stop:  # a second Ctrl-C: at once; the newest checkpoint stays
            self._shutdown_collector()
            stop.iteration = self.iterations_done
            raise
        except PeerLost:  # the job is ending: the sampler's collectives would wait on the dead peer
            raise
        except BaseException:  # an error: the sampler's thread, engine and Ray workers end too
            self._shutdown_collector(timeout=SHUTDOWN_AFTER_ERROR_S)
            raise
        self._shutdown_collector()
        if self.stopping and self.iteration < self.num_iterations:
            raise self._interrupted()
        self.run_stage("shutdown")  # the policy saved, the report written
        self.parallel.barrier()
        return self.report

    def _shutdown_collector(self, timeout: float | None = None) -> None:
        """The collector's ``shutdown()``, if it has one. With ``timeout`` (the way out of an
        error) it runs in a thread of its own and the error goes on after ``timeout`` seconds at
        most: a batch being sampled finishes first, and the error is what the user needs to see;
        a failed shutdown is logged, never raised over the error."""
        shutdown = getattr(self.collector, "shutdown", None)
        if shutdown is None:
            return
        if timeout is None:
            shutdown()
            return

        def quietly():
            try:
                shutdown()
            except Exception as error:  # noqa: BLE001 - the error being raised matters more
                log.warning("Shutting the collector down after an error failed too (%s: %s).",
                            type(error).__name__, error)

        worker = threading.Thread(target=quietly, name="collector-shutdown", daemon=True)
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            log.warning("The collector is still shutting down %g s after the error (a batch "
                        "being sampled finishes first); it goes on in the background.", timeout)

    def _interrupted(self) -> RunInterrupted:
        """The stop after a signal's iteration, naming the checkpoint written."""
        checkpointer = self.hooks.get("checkpoint")
        path = getattr(checkpointer, "last_path", None)
        done = f"{self.iterations_done} of {self.num_iterations} iterations"
        saved = (f"checkpoint {path}" if path is not None else
                 "no checkpoint (checkpoints are off: checkpoint.every=0), so it cannot resume")
        return RunInterrupted(f"Stopped by {signal_name(self.stopping)} after {done}: {saved}.",
                              signum=self.stopping, iteration=self.iterations_done, checkpoint=path)

    def _iterate(self, rollouts) -> None:
        """The iterations left, until the last or a stop signal's."""
        while self.iteration < self.num_iterations and not self.stopping:
            self.metrics, start = {}, time.perf_counter()
            self.run_stage("pre_collect")  # thread tuning
            self.actor.model.eval()
            # 1. Collect: responses to this process's prompts, truncated after the stop token.
            with self.timed("generation"):
                rollout = next(rollouts)
            rollout = self.run_stage("batch_process", rollout)  # the on-policy check
            # 2. Score: one scalar per response (reward model / functions, missing-EOS penalty).
            with self.timed("scoring"):
                self.scorer(rollout)
                if self.reward_transform is not None:  # e.g. a TorchRL Transform on "score"
                    rollout = self.reward_transform(rollout)
            # 3. Old quantities, no grad: policy, reference (and teacher) log-probs (fp32,
            #    temperature), values.
            with self.timed("old_quantities"):
                self.old_quantities(rollout)
            # 4-6. On the global batch: per-token KL rewards, advantages, then PPO epochs.
            batch, stats = self.optimise(rollout)
            self.updated = True
            self.run_stage("post_steps")  # the sampler gets the updated weights
            # 7. Log: the global batch's statistics (the same on every process).
            self.log_iteration(batch, stats, start)
            self.iteration, self.updated = self.iteration + 1, False

    def old_quantities(self, rollout: TensorDictBase) -> None:
        """Phase 3: old log-probs (unless recorded while sampling), reference log-probs, values;
        with a teacher, its log-probs too.

        Args:
            rollout: this process's scored rollout, written in place.
        """
        if self.keep_sampler_log_probs:
            # the sampler's log-probs stay beside the recomputed ones: TIS and the gap metric
            rollout.set(K.BEHAVIOUR_LOG_PROB, rollout.get(K.LOG_PROB).clone())
        # an offloaded reference visits the device while it runs (LoRA: the policy, adapters off)
        reference = None if getattr(self.reference, "adapters_off", False) else self.reference.model
        with placed(reference, module_device(self.actor.model), self.offload_reference):
            compute_old_quantities(rollout, actor=self.actor, reference=self.reference, critic=self.critic,
                             chunk_size=self.forward_batch_size, exact_entropy=self.exact_entropy,
                             recompute_log_probs=self.recompute_log_probs)
        if self.teacher is not None:  # (an offloaded teacher visits the device while it runs)
            self.teacher(rollout)

    def optimise(self, rollout: TensorDictBase) -> tuple[TensorDictBase, dict | None]:
        """Phases 4-6 on the global batch (every process's rows): KL-shaped rewards, advantages
        (whitened over the whole batch, or the rows the group filter keeps), PPO epochs (each
        process runs its slice of each minibatch). A NaN/inf is caught where it appears (the same
        decision on every process); returns the batch and the update's statistics (None: a
        skipped iteration; empty: every group filtered out, no update).

        Args:
            rollout: this process's rollout with its old quantities.
        """
        batch = stats = None
        try:
            with self.timed("advantages"):
                batch = self.parallel.gather_rollout(rollout, self.pad_token_id)
                check_finite(batch, ("scores", "log-probs", "sampler log-probs",
                                     "reference log-probs", "values"))
                self.shaper(batch)  # every row's rewards (the metrics and the KL controller's)
                self.metrics["objective/kl_coef"] = self.shaper.kl_coef  # the one that shaped them
                check_finite(batch, ("rewards",))
                # DAPO's filter before the advantages: their statistics are the kept rows' alone
                train_batch = self.informative_rows(batch) if self.filter_groups else batch
                if train_batch.shape[0]:
                    self.advantage(train_batch)
                    check_finite(train_batch, ("advantages", "returns"))
            if train_batch.shape[0] == 0:
                stats = {}  # no group has a signal: no update
            else:
                with self.timed("update"):
                    stats = ppo_update(
                        train_batch, self.loss_module, self.optimizer, **self.update.kwargs(),
                        scheduler=self.scheduler, replay_buffer=self.replay_buffer,
                        grad_scaler=self.grad_scaler, parallel=self.parallel)
                self.metrics.update(self.critic_warmup.after_update(
                    train_batch, stats, self.iteration, self.scheduler))
            self.update_kl_coef(batch)  # the next iteration's, right after the update
        except NonFiniteError as error:
            if self.on_non_finite is None:
                raise
            self.on_non_finite(error, self.iteration, batch)  # raises to stop; returns to skip
        return batch, stats

    def informative_rows(self, batch: TensorDictBase) -> TensorDictBase:
        """The rows of the shaped ``batch`` whose group's scores, as the group baseline compares
        them (:func:`~rlhf_torchrl.objectives.advantages.group_scores`), are not all equal (DAPO's dynamic
        filtering), shaped again on their own (a whitened score's statistics are then the kept
        rows'); the share of rows dropped goes to ``group/filtered_frac``.

        Args:
            batch: the shaped global batch.
        """
        keep = informative_groups(batch)
        self.metrics["group/filtered_frac"] = 1.0 - float(keep.float().mean())
        kept = batch[keep]
        if kept.shape[0]:
            self.shaper(kept)
        return kept

    def log_iteration(self, batch: TensorDictBase, stats: dict | None, start: float) -> None:
        """Phase 7: the iteration's metrics row and the log hooks.

        Args:
            batch: the iteration's global batch.
            stats: the update's statistics (None: a skipped iteration).
            start: the iteration's start, a ``time.perf_counter()`` reading in seconds.
        """
        metrics = self.metrics
        if stats is None:  # a skipped iteration
            metrics["guard/skipped"] = 1.0
        else:
            metrics.update(rollout_metrics(batch, kl_coef=metrics["objective/kl_coef"]))
            metrics.update(group_metrics(batch))
            metrics.update(sampler_metrics(batch, version=self.iteration))
            metrics.update(stats)
        # response tokens per second of sampling: under overlap the sampler's own clock (the
        # trainer waited only for part of it); several processes sample in parallel, so the slowest
        n_tokens = float(batch.get(K.RESPONSE_MASK).sum())
        sampling = metrics["time/generation"]
        if K.SAMPLING_SECONDS in batch.keys():
            sampling = metrics["time/sampling"] = float(batch.get(K.SAMPLING_SECONDS).max())
        metrics["time/tokens_per_second"] = n_tokens / max(sampling, 1e-9)
        phases = [v for k, v in metrics.items() if k.startswith("memory/") and k.endswith("_gpu_gb")]
        if phases:  # CUDA: the iteration's peak, what the memory plan is checked against
            metrics["memory/gpu_peak_gb"] = max(phases)
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        metrics["episode"] = self.iterations_done * batch.shape[0]
        self.run_stage("post_steps_log", batch)  # evaluation, the KL ceiling, the report's samples
        # a background sampler of the trained model itself (overlap=0) waits: under FSDP2 its
        # forwards, the stop signal's all-reduce and a sharded checkpoint are all collectives,
        # and two threads' collectives interleaved differently on two processes deadlock
        # (AsyncCollector.paused)
        with getattr(self.collector, "paused", nullcontext)():
            # a stop signal (Ctrl-C, SIGTERM) on any process: every process checkpoints this
            # iteration
            interrupt = getattr(self, "interrupt", None)
            self.stopping = self.parallel.max_int(interrupt.requested or 0) if interrupt else 0
            self.run_stage("checkpoint")  # (timed: in time/total)
        metrics["time/total"] = time.perf_counter() - start
        self.run_stage("log", metrics)
        if self.stop_error is not None:
            raise self.stop_error

    def update_kl_coef(self, batch: TensorDictBase) -> None:
        """The adaptive KL coefficient's step. A batch sampled by the policy of the critic
        warm-up (updates 0..warm-1 left it as it was) has a KL of 0, which says nothing about the
        coefficient: it waits (for a warm-up that ends on its own, until it has ended).

        Args:
            batch: the iteration's shaped batch.
        """
        sampled_by = (int(batch.get(K.POLICY_VERSION).min()) if K.POLICY_VERSION in batch.keys()
                      else self.iteration)  # asynchronous rows record their version
        warm = self.critic_warmup.warmup_iterations  # None while a warm-up runs on
        if warm is not None and (sampled_by > warm or not warm):
            self.shaper.update_kl_coef(batch)

    # ---- state ----------------------------------------------------------------------------------
    @property
    def trained_modules(self) -> dict[str, nn.Module]:
        """The modules whose parameters the optimiser updates, each once: the policy, the value
        head and a separate critic's trunk (a shared trunk is the policy's; no critic: the policy)."""
        if self.critic is None:
            return {"policy": self.actor.model}
        modules = {"policy": self.actor.model, "value_head": self.critic.head}
        if not self.critic.shares_trunk:
            modules["critic_trunk"] = self.critic.backbone
        return modules

    def pending_rollouts(self) -> list:
        """This process's rollouts sampled ahead by older weights (asynchronous collection), or
        its responses partial rollouts paused (one TensorDict); none after the last iteration: a
        checkpoint keeps them, each process its own rows."""
        pending = getattr(self.collector, "pending", None)
        return pending() if pending is not None and self.iterations_done < self.num_iterations else []

    def state_dict(self) -> dict:
        """What an exact resume needs besides weights, optimiser and the rollouts sampled ahead
        (see the class docstring): plain containers, loadable with ``weights_only=True``."""
        return {
            "iteration": self.iterations_done,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
            "kl_coef": getattr(self.shaper, "kl_coef", None),
            # the minibatch shuffle's own generator (None: torch's global one, in "rng")
            "minibatch_rng": (self.replay_buffer._rng.get_state()
                              if getattr(self.replay_buffer, "_rng", None) is not None else None),
            "rng": rng_state(),
            "pending": len(self.pending_rollouts()),  # (the rollouts: one folder per process)
            "world_size": self.parallel.world_size,
            "hooks": {name: hook.state_dict() for name, hook in self.hooks.items()},
            "critic_warmup": self.critic_warmup.state_dict(),
            # a reward transform's running state (per-source score statistics; None: not a module)
            "reward_transform": (self.reward_transform.state_dict()
                                 if isinstance(self.reward_transform, nn.Module) else None),
        }

    def load_state_dict(self, state: Mapping) -> None:
        self.iteration = self.first_iteration = state["iteration"]
        self.updated = False
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.grad_scaler is not None and state["grad_scaler"] is not None:
            self.grad_scaler.load_state_dict(state["grad_scaler"])
        if getattr(self.shaper, "kl_controller", None) is not None:
            self.shaper.kl_controller.coef = state["kl_coef"]
        if state["minibatch_rng"] is not None and getattr(self.replay_buffer, "_rng", None) is not None:
            self.replay_buffer._rng.set_state(state["minibatch_rng"])
        self.restored_rng = state["rng"]  # set by fit(), once the collector is built
        if state.get("critic_warmup") is not None:  # (checkpoints of earlier versions: none)
            self.critic_warmup.load_state_dict(state["critic_warmup"])
        for name, hook_state in state["hooks"].items():
            if name in self.hooks:
                self.hooks[name].load_state_dict(hook_state)
        if state.get("reward_transform") is not None and isinstance(self.reward_transform, nn.Module):
            self.reward_transform.load_state_dict(state["reward_transform"])

    def load_checkpoint(self, path: str) -> None:
        """Continue from checkpoint ``path``: trained weights, optimiser, :meth:`state_dict` and
        this process's rollouts sampled ahead.

        Args:
            path: a checkpoint directory (``<output_dir>/checkpoints/iter_<n>``).
        """
        state = load_checkpoint(path, modules=self.trained_modules, optimizer=self.optimizer)
        if state["pending"] and state["world_size"] != self.parallel.world_size:
            raise ConfigError(
                f"Checkpoint {path} holds rollouts sampled ahead by each of {state['world_size']} "
                f"processes; resume it with {state['world_size']} (now {self.parallel.world_size}).")
        self.load_state_dict(state)
        own = load_rng_state(path, self.parallel.rank)  # this process's (None: an older checkpoint)
        if own is not None:
            self.restored_rng = own
        self.pending = load_rollouts(path, self.parallel.rank, module_device(self.actor.model))
        log.info("Resumed from %s: %d of %d iterations done", path, self.iteration,
                 self.num_iterations)
