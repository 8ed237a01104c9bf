"""The trackers behind logging.logger, read back with their own readers: TensorBoard's
EventAccumulator, W&B's offline run file, MLflow's client. Each gets the project, the run name and
tags, the resolved config as hyperparameters and each evaluation's sample responses; with
output_dir set, the command writes nothing in the working directory."""

import glob
import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_torchrl.cli import with_run_dir
from rlhf_torchrl.errors import ConfigError, MissingDependencyError
from rlhf_torchrl.record.metrics import MetricsWriter
from rlhf_torchrl.record.trackers import check_logger, default_run_name, flatten

ROOT = Path(__file__).resolve().parents[1]
TINY = ["ppo.num_iterations=2", "ppo.batch_size=4", "ppo.num_mini_batches=2",
        "ppo.forward_batch_size=2", "generation.max_new_tokens=6", "logging.progress_bar=false",
        "data.limit=16", "eval.num_prompts=4", "eval.every=1", "optim.critic_warmup=0",
        "model.autocast=null", "checkpoint.every=0", "logging.save_model=false", "threads=1"]
RUN = ["logging.project=rlhf-test", "logging.run_name=tiny-run", "logging.tags=[baseline,seed0]"]


def test_output_dir_is_hydras_run_dir():
    assert with_run_dir(["task=custom", "output_dir=runs/a"]) == [
        "task=custom", "output_dir=runs/a", "hydra.run.dir=runs/a"]
    assert with_run_dir(["output_dir=runs/a", "hydra.run.dir=elsewhere"])[-1] == "hydra.run.dir=elsewhere"
    assert with_run_dir(["ppo.batch_size=4"]) == ["ppo.batch_size=4"]  # Hydra's dated folder


def test_logger_choices_and_packages(monkeypatch):
    with pytest.raises(ConfigError, match="csv, tensorboard, wandb, mlflow"):
        check_logger("neptune")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(MissingDependencyError, match=r"rlhf_torchrl\[logging\]"):
        check_logger("wandb")
    assert default_run_name("outputs/ppo/sentiment/2026-11-24_10-00-00") == "sentiment/2026-11-24_10-00-00"
    assert flatten({"ppo": {"batch_size": 8}, "reward": {"functions": ["a.b"]}, "x": None}) == {
        "ppo.batch_size": 8, "reward.functions": '["a.b"]', "x": "null"}


def _tensorboard(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(run_dir), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    texts = {tag.removesuffix("/text_summary"): {e.step: e.tensor_proto.string_val[0].decode()
                                                   for e in events.Tensors(tag)}
             for tag in events.Tags()["tensors"]}
    hparams = {}
    for content in events.PluginTagToContent("hparams").values():
        data = plugin_data_pb2.HParamsPluginData.FromString(content)
        if data.HasField("session_start_info"):
            for key, value in data.session_start_info.hparams.items():
                hparams[key] = value.number_value if value.HasField("number_value") else value.string_value
    scalars = {tag: [e.step for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    return texts, hparams, scalars


def test_command_line_run_writes_only_under_output_dir_and_tensorboard_reads_it(tmp_path,
                                                                                 tiny_llama_dir):
    """``rlhf-torchrl ppo output_dir=...`` from an empty working directory: Hydra's files go under
    output_dir, the working directory stays empty; TensorBoard's events hold the run's project,
    name and tags, the config as hyperparameters, and each evaluation's responses as text."""
    cwd, out = tmp_path / "cwd", tmp_path / "runs" / "one"
    cwd.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "rlhf_torchrl.cli", "ppo", f"output_dir={out}",
                           f"model.policy={tiny_llama_dir}", "logging.logger=tensorboard", *RUN, *TINY],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(cwd.iterdir()) == []  # no outputs/, no .hydra/, no log
    assert (out / ".hydra" / "config.yaml").is_file() and (out / "ppo.log").is_file()
    texts, hparams, scalars = _tensorboard(out / "tensorboard" / "tiny-run")
    run = texts["run"][0]
    assert "project: rlhf-test" in run and "run name: tiny-run" in run and "baseline, seed0" in run
    assert hparams["ppo.batch_size"] == 4 and hparams["logging.project"] == "rlhf-test"
    assert hparams["model.policy"] == tiny_llama_dir
    # evaluated before training (step 0) and after each of the 2 iterations (their rows' steps)
    assert list(texts["eval/samples_before"]) == [0] and sorted(texts["eval/samples"]) == [0, 1]
    assert "response:" in texts["eval/samples"][1] and "score" in texts["eval/samples"][1]
    assert scalars["objective/scores"] == [0, 1] and scalars["eval/score"] == [0, 1]


def wandb_records(path: str):
    """The records of an offline W&B run file (``run-<id>.wandb``): LevelDB's log framing, 32 KiB
    blocks of chunks, each with a 7-byte header (checksum, length, type: 1 whole, 2 first,
    3 middle, 4 last), after the file's 7-byte ``:W&B`` header; each record a protobuf."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's last bytes, too few for a header: padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if length == 0 and kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def test_wandb_offline_run_has_the_project_name_tags_config_and_samples(tmp_path, tiny_llama_dir,
                                                                         monkeypatch):
    sys.path.insert(0, str(ROOT / "recipes"))
    import ppo

    from rlhf_torchrl.config import compose

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    ppo.train(compose([f"output_dir={out}", f"model.policy={tiny_llama_dir}", "logging.logger=wandb",
                       "reuse_freed_memory=false", *RUN, *TINY]))
    assert sorted(os.listdir(tmp_path)) == ["run"]  # W&B's files in output_dir/wandb too
    [path] = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    config, tables = {}, {}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            assert (run.project, run.display_name, list(run.tags)) == (
                "rlhf-test", "tiny-run", ["baseline", "seed0"])
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            items = {item.key or "/".join(item.nested_key): item.value_json
                     for item in record.history.item}
            for name in ("eval/samples_before", "eval/samples"):
                if f"{name}/path" in items:
                    tables.setdefault(name, []).append(json.loads(items[f"{name}/path"]))
    assert config["ppo"]["batch_size"] == 4 and config["logging"]["tags"] == ["baseline", "seed0"]
    assert len(tables["eval/samples_before"]) == 1 and len(tables["eval/samples"]) == 2
    table = json.loads((Path(path).parent / "files" / tables["eval/samples"][-1]).read_text())
    assert table["columns"] == ["iteration", "prompt", "response", "score"]
    assert len(table["data"]) == 4 and table["data"][0][0] == 1  # 4 held-out prompts, iteration 1


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None
                    or importlib.util.find_spec("sqlalchemy") is None,
                    reason="MLflow is not installed (pip install -e '.[mlflow]': mlflow-skinny and "
                           "the SQLite store's SQLAlchemy); CI installs .[test] without it")
def test_mlflow_run_has_the_name_tags_params_and_samples(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    writer = MetricsWriter(str(tmp_path / "run"), logger="mlflow", project="rlhf-test",
                           run_name="tiny-run", tags=["baseline"])
    # more than the 100 parameters MLflow takes in one request
    writer.log_config({"ppo": {"batch_size": 4}, **{f"k{i}": i for i in range(150)}})
    writer.log(0, {"objective/scores": 0.25, "eval/pass@4": 0.5})  # MLflow refuses "@"
    writer.log_samples("eval/samples", 0, [{"prompt": "p", "question": "q", "response": "r",
                                            "score": 1.0}])
    writer.close()
    assert sorted(os.listdir(tmp_path)) == ["run"]
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    [run] = mlflow.search_runs(experiment_names=["rlhf-test"], output_format="list")
    assert run.info.run_name == "tiny-run" and run.data.tags["baseline"] == "true"
    assert run.data.params["ppo.batch_size"] == "4" and len(run.data.params) == 151
    assert run.data.metrics["objective/scores"] == 0.25
    assert run.data.metrics["eval/pass_at_4"] == 0.5
    [artifact] = mlflow.artifacts.list_artifacts(run_id=run.info.run_id, artifact_path="eval_samples")
    assert artifact.path == "eval_samples/iteration_000000.json"
