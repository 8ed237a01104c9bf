"""Collection on Ray workers, on a real local Ray cluster (CPU)."""

import json
import os
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="needs Ray: pip install 'ray==2.60.0'")
pytestmark = pytest.mark.xdist_group("serial")  # under pytest -n: one worker holds the cluster

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
