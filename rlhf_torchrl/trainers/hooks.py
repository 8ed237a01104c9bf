"""What the PPO trainer does besides the algorithm, as TorchRL trainer hooks.

Each hook is a :class:`torchrl.trainers.TrainerHookBase`: ``register(trainer, name)`` puts its ops
at the trainer's stages (:data:`rlhf_torchrl.trainers.stages.STAGES`), and ``state_dict()`` is saved in
every checkpoint, so that a resumed run continues each hook where it was. Register your own the same
way, or pass a plain function to ``trainer.register_op(stage, fn)``.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from contextlib import contextmanager, nullcontext

from torchrl.trainers import TrainerHookBase

from rlhf_torchrl import keys as K
from rlhf_torchrl.runtime import placed
from rlhf_torchrl.trainers.evaluation import format_metrics, rollout_samples

log = logging.getLogger(__name__)

#: held-out prompts whose responses before and after training the report shows side by side
HELD_OUT_SAMPLES = 8


class _Stateless(TrainerHookBase):
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class ThreadTuning(_Stateless):
    """Before each iteration, torch's intra-op threads follow the cores other processes leave
    free (:class:`~rlhf_torchrl.runtime.ThreadTuner`); logged as ``threads``.

    Args:
        tuner (rlhf_torchrl.runtime.ThreadTuner): picks the thread count.
    """

    def __init__(self, tuner):
        self.tuner = tuner

    def register(self, trainer, name: str = "threads") -> None:
        trainer.register_op("pre_collect", lambda: {"threads": self.tuner.update()})


class OnPolicyCheck(_Stateless):
    """The first batch's recorded log-probs (and values, where the sampling pass recorded them)
    against a training forward's (:func:`~rlhf_torchrl.collectors.on_policy.check_on_policy`): PPO's first
    ratio is 1 only if the tokens came from the loss's distribution. A sampler that gets pushed weights (vLLM, a Ray worker, a
    copy) is checked again on the batch after its first push; a resumed run checks its first
    batch unless it was sampled before the interruption. With partial rollouts only the tokens the
    current weights sampled are compared (a paused response's earlier tokens came from older ones).

    Args:
        num_rows: rows of the batch compared.
        atol: the largest absolute difference allowed, in nats (values: the same number).
        recheck_after_push: check again on the batch after the sampler's first weight push.
    """

    def __init__(self, *, num_rows: int = 4, atol: float = 1e-3, recheck_after_push: bool = False):
        self.num_rows, self.atol, self.recheck_after_push = num_rows, atol, recheck_after_push

    def register(self, trainer, name: str = "on_policy_check") -> None:
        self.trainer = trainer
        trainer.register_op("batch_process", self)

    def __call__(self, rollout):
        from rlhf_torchrl.collectors.on_policy import check_on_policy

        t = self.trainer
        first = t.iteration == t.first_iteration and not t.pending
        recheck = self.recheck_after_push and t.iteration == t.first_iteration + 1
        if first or recheck:
            rows, tokens = rollout, None
            if K.TOKEN_VERSION in rollout.keys(True):  # partial rollouts: several versions a row
                from rlhf_torchrl.collectors.partial import current_tokens

                rows, tokens = current_tokens(rollout, t.iteration)
                if not rows.shape[0]:
                    return rollout  # no token of this batch was sampled by the current weights
            agreement = check_on_policy(rows, t.actor, num_rows=self.num_rows, atol=self.atol,
                                        critic=t.critic, tokens=tokens)
            log.info("On-policy check: recorded and recomputed log-probs of %d tokens agree to %.2g "
                     "nats%s", agreement["tokens"], agreement["max_abs_diff"],
                     f", values to {agreement['value_max_abs_diff']:.2g}"
                     if "value_max_abs_diff" in agreement else "")
        return rollout


class WeightPush(_Stateless):
    """After each update (but the last), a sampler with weights of its own gets the trainer's:
    the collector's ``update_weights(version)`` (``AsyncCollector``, ``SyncedCollector``) returns
    the seconds it took, logged as ``time/weight_sync`` (TorchRL's ``UpdateWeights``). A collector
    that samples with the trained model itself has nothing to push."""

    def register(self, trainer, name: str = "weight_push") -> None:
        self.trainer = trainer
        trainer.register_op("post_steps", self)

    def __call__(self):
        t = self.trainer
        push = getattr(t.collector, "update_weights", None)
        if push is not None and t.iterations_done < t.num_iterations:
            return {"time/weight_sync": push(t.iterations_done)}  # version = updates done
        return None


class Evaluation(TrainerHookBase):
    """Held-out evaluation (:class:`~rlhf_torchrl.trainers.evaluation.Evaluator`): the reference's
    responses once, the untrained policy's at setup, then every ``every`` iterations and after the
    last (``eval/...`` metrics, timed as ``time/eval``). Keeps the before/after responses of the
    first :data:`HELD_OUT_SAMPLES` prompts for the report, and each evaluation's for the tracker
    (``unlogged_samples``, which :class:`~rlhf_torchrl.record.run_log.RunLog` sends: ``eval/samples_before``, ``eval/samples``).

    Args:
        evaluator (rlhf_torchrl.trainers.evaluation.Evaluator): samples and scores the held-out prompts.
        every: evaluate every this many iterations (and after the last).
        policy (torch.nn.Module): the trained policy model.
        reference (torch.nn.Module | None): the reference model (None with LoRA: the policy with
            its adapters off).
        device (torch.device | None): where the reference runs while it answers.
        offload_reference: the reference visits ``device`` only while it answers.
    """

    def __init__(self, evaluator, *, every: int, policy, reference=None, device=None,
                 offload_reference: bool = False):
        self.evaluator, self.every, self.policy = evaluator, every, policy
        self.reference, self.device, self.offload_reference = reference, device, offload_reference
        self.before = self.held_out_before = self.held_out_after = None
        #: (name, step, samples) of the evaluations not yet sent to the tracker (RunLog takes them)
        self.unlogged_samples: list[tuple[str, int, list[dict]]] = []

    def register(self, trainer, name: str = "evaluation") -> None:
        self.trainer = trainer
        trainer.register_op("setup", self.setup)
        trainer.register_op("post_steps_log", self.maybe_evaluate)

    @contextmanager
    def _reference_model(self):
        if self.reference is not None:
            with placed(self.reference, self.device, self.offload_reference):
                yield self.reference
        else:
            with self.policy.disable_adapter():
                yield self.policy

    def setup(self) -> None:
        with self._reference_model() as model:
            self.evaluator.set_reference(model)  # the reference's responses, once
        if self.before is None:
            self.before, rollout = self.evaluator(self.policy)
            self.held_out_before = rollout_samples(rollout, HELD_OUT_SAMPLES, one_per_prompt=True)
            self.unlogged_samples.append(("eval/samples_before", 0, self.held_out_before))
            log.info("Evaluation before training: %s", format_metrics(self.before))

    def maybe_evaluate(self, batch) -> dict | None:
        done, last = self.trainer.iterations_done, self.trainer.num_iterations
        if done % self.every and done != last:
            return None
        start = time.perf_counter()
        # a background sampler may use this very model (overlap=0): it waits meanwhile
        with getattr(self.trainer.collector, "paused", nullcontext)():
            metrics, rollout = self.evaluator(self.policy)  # held-out prompts, after this update
        self.held_out_after = rollout_samples(rollout, HELD_OUT_SAMPLES, one_per_prompt=True)
        # at the step of this iteration's row (its eval/ metrics)
        self.unlogged_samples.append(("eval/samples", self.trainer.iteration, self.held_out_after))
        return {**metrics, "time/eval": time.perf_counter() - start}

    def report(self, history: list[dict]) -> dict:
        """The report's evaluation entries: before, after, and the held-out responses paired.

        Args:
            history: the run's metrics rows.
        """
        if self.before is None or not history:
            return {}
        out = {"eval_before": self.before,
               "eval_after": {k: v for k, v in history[-1].items() if k.startswith("eval/")}}
        if self.held_out_before and self.held_out_after:
            out["held_out_samples"] = [
                {"prompt": b["prompt"], "question": b.get("question", b["prompt"]),
                 "before": b["response"], "score_before": b["score"],
                 "after": a["response"], "score_after": a["score"]}
                for b, a in zip(self.held_out_before, self.held_out_after)
                if b["prompt"] == a["prompt"]]
        return out

    def state_dict(self) -> dict:
        return {"eval_before": self.before, "held_out_before": self.held_out_before}

    def load_state_dict(self, state_dict: dict) -> None:
        self.before = state_dict["eval_before"]
        self.held_out_before = state_dict["held_out_before"]


class KLCeiling(_Stateless):
    """Warn (or, with ``stop``, stop the run with :class:`~rlhf_torchrl.trainers.guards.DivergenceError`
    once this iteration's metrics are written, without its checkpoint) when the KL to the
    reference passes ``ceiling`` nats per response.

    Args:
        ceiling: the KL to the reference, in nats per response, that triggers it.
        stop: stop the run rather than warn.
    """

    def __init__(self, ceiling: float, stop: bool = False):
        self.ceiling, self.stop = ceiling, stop

    def register(self, trainer, name: str = "kl_ceiling") -> None:
        self.trainer = trainer
        trainer.register_op("post_steps_log", self)

    def __call__(self, batch) -> None:
        from rlhf_torchrl.trainers.guards import DivergenceError, check_kl_ceiling

        kl = self.trainer.metrics.get("objective/kl")
        if kl is None:
            return
        try:
            check_kl_ceiling(kl, self.trainer.iteration, ceiling=self.ceiling, stop=self.stop)
        except DivergenceError as error:
            self.trainer.request_stop(error)


class Checkpointer(TrainerHookBase):
    """A checkpoint (:func:`~rlhf_torchrl.trainers.checkpoint.save_checkpoint`) every ``every`` iterations
    and after the last: the trained weights, the optimiser, the trainer's :meth:`state_dict`, each
    process's RNG states and ``config_yaml``; the newest ``keep`` of this run's lineage are kept
    (a resumed run's abandoned future is moved aside). Timed as ``time/checkpoint`` (in
    ``time/total``).

    Args:
        output_dir: the run's directory; checkpoints go to ``<output_dir>/checkpoints``.
        every: a checkpoint every this many iterations and after the last (0: none).
        keep: how many of the newest checkpoints to keep (None: all).
        config_yaml: the run's config, saved with each checkpoint.
        weights_only: leave the optimiser's state out (``checkpoint.weights_only``).
    """

    def __init__(self, output_dir: str, *, every: int, keep: int | None = None,
                 config_yaml: str = "", weights_only: bool = False):
        self.output_dir, self.every, self.keep, self.config_yaml = output_dir, every, keep, config_yaml
        self.weights_only = weights_only
        # [run, resumed_at] of the runs whose checkpoints this one continues, then this run's
        self.lineage: list[list] = []
        self.run_id = uuid.uuid4().hex[:12]
        self.last_path: str | None = None  # the newest checkpoint this run wrote

    def register(self, trainer, name: str = "checkpoint") -> None:
        self.trainer = trainer
        trainer.register_op("checkpoint", self)

    def due(self, done: int) -> bool:
        """On the schedule, after the last iteration, or after the iteration a stop signal ended
        (:mod:`~rlhf_torchrl.trainers.interrupt`)."""
        return bool(self.every) and (done % self.every == 0 or done == self.trainer.num_iterations
                                     or bool(getattr(self.trainer, "stopping", 0)))

    def __call__(self) -> dict | None:
        from rlhf_torchrl.trainers.checkpoint import rng_state, save_checkpoint

        t = self.trainer
        if not self.due(t.iterations_done) or t.stop_error is not None:
            return None
        start = time.perf_counter()
        if not self.lineage or self.lineage[-1][0] != self.run_id:  # (before the state is taken)
            self.lineage.append([self.run_id, t.first_iteration])
        self.last_path = save_checkpoint(self.output_dir, t.iterations_done, modules=t.trained_modules,
                        optimizer=t.optimizer, keep=self.keep, parallel=t.parallel,
                        config_yaml=self.config_yaml, trainer_state=t.state_dict(),
                        rollouts=t.pending_rollouts(), rng=rng_state(), lineage=self.lineage,
                        weights_only=self.weights_only)
        seconds = time.perf_counter() - start
        log.info("Checkpoint %d written in %.2f s", t.iterations_done, seconds)
        return {"time/checkpoint": seconds}

    def state_dict(self) -> dict:
        return {"lineage": [list(segment) for segment in self.lineage]}

    def load_state_dict(self, state_dict: dict) -> None:
        # (a checkpoint of an earlier version records none: its lineage starts at this run)
        self.lineage = [list(segment) for segment in state_dict.get("lineage", [])]


class SavePolicy(_Stateless):
    """At the end, the trained policy as a Hugging Face checkpoint in ``<output_dir>/policy``
    (gathered from the shards under FSDP2; LoRA: the adapters, and with ``save_merged`` the merged
    weights in ``policy_merged``), with the tokenizer.

    Args:
        output_dir: the run's directory.
        tokenizer (transformers.PreTrainedTokenizerBase): saved beside the policy.
        save_merged: with LoRA, also the merged weights in ``policy_merged``.
    """

    def __init__(self, output_dir: str, tokenizer, *, save_merged: bool = False):
        self.output_dir, self.tokenizer, self.save_merged = output_dir, tokenizer, save_merged

    def register(self, trainer, name: str = "save_policy") -> None:
        self.trainer = trainer
        trainer.register_op("shutdown", self)

    def __call__(self) -> None:
        import copy

        from rlhf_torchrl.modules.models import save_tokenizer

        t = self.trainer
        policy = t.actor.model
        state = t.parallel.full_state_dict(policy)  # every process takes part under FSDP2
        if not t.parallel.is_main:
            return
        path = os.path.join(self.output_dir, "policy")
        policy.save_pretrained(path, state_dict=state)
        save_tokenizer(self.tokenizer, path)  # (padding on the left, as it samples)
        if self.save_merged:
            merged_path = os.path.join(self.output_dir, "policy_merged")
            merged = copy.deepcopy(policy).merge_and_unload()  # the live policy keeps its adapters
            merged.save_pretrained(merged_path)
            save_tokenizer(self.tokenizer, merged_path)
