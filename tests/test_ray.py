"""Collection on Ray workers, on a real local Ray cluster (CPU)."""

import json
import logging
import os
import signal
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="needs Ray: pip install 'ray==2.60.0'")
pytestmark = [pytest.mark.xdist_group("serial"),  # under pytest -n: one worker holds the cluster
              pytest.mark.processes]  # the suite of its own (pyproject.toml's markers)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray 2.60's token auth writes ~/.ray
    # the workers import the installed package only: no recipes/ (nor the checkout) on their path
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


def _run(tmp_path, model_dir, *overrides):
    import ppo
    from test_recipe import _cfg

    ppo.train(_cfg(tmp_path, model_dir, "ppo.num_iterations=3", "threads=1", *overrides))
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def _comparable(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items()
            if not k.startswith(("time/", "async/")) and k != "threads"}


def test_two_ray_workers_sample_what_one_process_samples(tmp_path, tiny_llama_dir, cluster):
    """Each worker samples its half of every batch with its own policy copy; weights are pushed
    after every update. Metrics equal the single-process run's (rows have their own streams)."""
    local = _run(tmp_path / "local", tiny_llama_dir)
    remote = _run(tmp_path / "ray", tiny_llama_dir, "collection.ray_workers=2")
    for a, b in zip(remote, local):
        a, b = _comparable(a), _comparable(b)
        assert a.keys() == b.keys()
        for key in a:
            # fp32 log-probs of the same rows in batches of another shape: the KL (a difference
            # of nearly equal log-probs, summed over the response) agrees to ~1e-6 nats per token.
            # The explained variance divides by the variance of 4 responses' returns (-37 here,
            # the tiny model's returns barely vary): the same ~1e-6 in the values moves it by 1e-5
            rel = 1e-4 if key == "val/explained_variance" else 1e-5
            assert a[key] == pytest.approx(b[key], rel=rel, abs=1e-5), key
    assert all(m["time/weight_sync"] > 0 for m in remote[:-1])


def test_ray_workers_run_ahead_of_the_trainer(tmp_path, tiny_llama_dir, cluster):
    lines = _run(tmp_path, tiny_llama_dir, "collection.ray_workers=2", "collection.overlap=1")
    assert [m["async/staleness"] for m in lines] == [0, 1, 1]
    assert ray.is_initialized()  # the recipe leaves a cluster it did not start alone


def test_ray_workers_run_episodes_with_tools(tmp_path, tool_llama_dir, cluster):
    """Each worker runs its rows' episodes (its own tools, the same per-turn streams): the
    metrics equal the single-process run's, tool calls and turns included."""
    from test_multiturn import episode_settings

    settings = episode_settings(tmp_path)
    local = _run(tmp_path / "local", tool_llama_dir, *settings)
    remote = _run(tmp_path / "ray", tool_llama_dir, *settings, "collection.ray_workers=2")
    assert local[0]["env/tool_calls_per_episode"] > 0
    for a, b in zip(remote, local):
        a, b = _comparable(a), _comparable(b)
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-5), key


def _kill_worker(trainer, rank: int, after: int):
    """A trainer op: SIGKILL Ray worker ``rank``'s process once ``after`` iterations are done."""
    def op():
        if trainer.iterations_done == after:
            worker = trainer.collector.collector.workers[rank]  # the SyncedCollector's RayCollector
            os.kill(ray.get(worker.__ray_call__.remote(lambda _: os.getpid()), timeout=60),
                    signal.SIGKILL)
    return op


def test_killed_ray_workers_are_replaced_and_the_run_is_the_same(tmp_path, tiny_llama_dir, cluster,
                                                                  caplog):
    """Worker 1 SIGKILLed after update 1 (the weight push finds it dead) and worker 0 before
    batch 2 (asked for it dead): each is replaced at batch 2 with the pushed weights, and the run
    logs what the uninterrupted run logs. With no restarts left the run stops with one line, its
    checkpoint intact, and resume=auto continues it to the same rows."""
    from test_recipe import _cfg

    from rlhf_torchrl.cli import USER_ERRORS
    from rlhf_torchrl.config import builders
    from rlhf_torchrl.errors import SamplerError
    from rlhf_torchrl.trainers.checkpoint import list_checkpoints, verify_checkpoint

    settings = ["threads=1", "collection.ray_workers=2", "checkpoint.every=1", "eval.every=0"]
    builders.train(_cfg(tmp_path / "whole", tiny_llama_dir, *settings))
    whole = [_comparable(m) for m in _rows(tmp_path / "whole")]

    def killing_run(out, *extra, kills):
        trainer = builders.build_trainer(_cfg(out, tiny_llama_dir, *settings, *extra))
        for stage, rank in kills:  # registered before the weight push, which fit() adds
            trainer.register_op(stage, _kill_worker(trainer, rank, after=1))
        try:
            trainer.fit()
        finally:
            trainer.parallel.shutdown()

    with caplog.at_level(logging.WARNING, logger="rlhf_torchrl.collectors.ray"):
        killing_run(tmp_path / "killed", kills=[("post_steps", 1), ("pre_collect", 0)])
    assert [_comparable(m) for m in _rows(tmp_path / "killed")] == whole
    replaced = [r.getMessage() for r in caplog.records if "takes its place" in r.getMessage()]
    assert [m.split(":")[0] for m in replaced] == [
        "Ray worker 1 died (ActorDiedError) while loading weights",
        "Ray worker 0 died (ActorDiedError) while sampling batch 2"], replaced

    with pytest.raises(SamplerError, match="Ray worker 1 died .* while sampling batch 2, and "
                                           "collection.worker_restarts=0") as stop:
        killing_run(tmp_path / "stops", "collection.worker_restarts=0",
                    kills=[("pre_collect", 1)])
    assert isinstance(stop.value, USER_ERRORS) and "\n" not in str(stop.value)  # one line
    (done, path), = list_checkpoints(tmp_path / "stops")
    assert done == 1
    verify_checkpoint(path)
    builders.train(_cfg(tmp_path / "stops", tiny_llama_dir, *settings))  # resume=auto
    assert [_comparable(m) for m in _rows(tmp_path / "stops")] == whole


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
