"""A checkpoint or model folder is data, never code: every loader, given a planted payload (a
pickle whose unpickling calls ``exec`` to create a marker file), refuses it with one line naming
the file, and the marker is never created. The attacker updates ``manifest.json`` to match, so
the size check does not stop it first."""

import io
import json
import pickle
from pathlib import Path

import pytest
import torch
from tensordict import NonTensorStack, TensorDict
from test_recipe import _cfg, ppo

from rlhf_torchrl import cli
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.modules.models import byte_tokenizer, load_causal_lm, load_sequence_classifier
from rlhf_torchrl.safe_loading import UnsafeFileError, load_dcp
from rlhf_torchrl.trainers.checkpoint import (
    list_checkpoints,
    load_checkpoint,
    load_rng_state,
    load_rollouts,
    load_trainer_state,
    rng_state,
    save_checkpoint,
    verify_checkpoint,
)
from rlhf_torchrl.trainers.warm_start import load_critic


class _Payload:
    """Unpickling it calls ``exec``: what a planted file does (here, create ``marker``)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


@pytest.fixture
def marker(tmp_path) -> Path:
    return tmp_path / "code_ran"


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()  # (the optimiser's moments: tensors; its param_groups: DCP's byte entries)
    return model, optimizer


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """A checkpoint of a Linear with AdamW, random states and one rollout holding texts."""
    model, optimizer = _model_and_optimizer()
    rollout = TensorDict({"tokens": torch.arange(6).reshape(2, 3),
                          "text": NonTensorStack("a", "b")}, batch_size=[2])
    return Path(save_checkpoint(str(tmp_path / "run"), 1, modules={"m": model},
                                optimizer=optimizer, trainer_state={"iteration": 1},
                                config_yaml="a: 1\n", rollouts=[rollout], rng=rng_state()))


def _resign_manifest(path: Path) -> None:
    """Sizes of every file as they are now: the attacker's manifest."""
    files = [p for p in path.rglob("*") if p.is_file() and p.name != "manifest.json"]
    (path / "manifest.json").write_text(json.dumps(
        {str(p.relative_to(path)): p.stat().st_size for p in files}))


def _metadata(path: Path):
    with open(path / "weights" / ".metadata", "rb") as f:
        return pickle.load(f)  # (the test's own file, just written)


def _plant_metadata(path: Path, marker: Path) -> Path:
    """``weights/.metadata``: the real metadata, a payload hidden inside: a resume that runs it
    then loads as if nothing happened."""
    metadata = _metadata(path)
    metadata.storage_meta.modules = [_Payload(marker)]
    file = path / "weights" / ".metadata"
    file.write_bytes(pickle.dumps(metadata))
    _resign_manifest(path)
    return file


def _plant_byte_entry(path: Path, marker: Path) -> Path:
    """A non-tensor entry of the weights (the optimiser's ``lr``) pointed at a payload appended
    to the shard file: DCP loads such entries with ``torch.load(weights_only=False)``."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = _metadata(path)
    fqn = next(k for k, v in metadata.state_dict_metadata.items()
               if isinstance(v, BytesStorageMetadata) and k.endswith(".lr"))
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    info = metadata.storage_data[index]
    shard = path / "weights" / info.relative_path
    payload = io.BytesIO()
    torch.save(_Payload(marker), payload)
    info.offset, info.length = shard.stat().st_size, len(payload.getvalue())
    with open(shard, "ab") as f:
        f.write(payload.getvalue())
    (path / "weights" / ".metadata").write_bytes(pickle.dumps(metadata))
    _resign_manifest(path)
    return shard


def _plant_torch_file(file: Path, marker: Path) -> Path:
    state = torch.load(file, weights_only=True)
    torch.save({**state, "extra": _Payload(marker)}, file)
    _resign_manifest(file.parent.parent if file.parent.name == "rng" else file.parent)
    return file


def _plant_rollout(path: Path, marker: Path) -> Path:
    """The rollout's texts as a pickle sidecar (TensorDict's format for data JSON cannot hold)."""
    folder = next((path / "rollouts").glob("rank_0/*/text"))
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "data": "pickle.pkl"}))
    file = folder / "pickle.pkl"
    file.write_bytes(pickle.dumps(_Payload(marker)))
    _resign_manifest(path)
    return file


def _load(path: Path):
    model, optimizer = _model_and_optimizer()
    return load_checkpoint(str(path), modules={"m": model}, optimizer=optimizer)


def _refused(call, file: Path, marker: Path) -> None:
    """``call()`` refuses with one line naming ``file``, and nothing ran."""
    with pytest.raises(ConfigError) as raised:
        call()
    message = str(raised.value)
    assert str(file) in message and "nothing in it ran" in message and "\n" not in message
    assert isinstance(raised.value, UnsafeFileError)
    assert not marker.exists(), "the payload ran"


def test_the_restricted_readers_load_what_the_library_writes(ckpt):
    """Weights, optimiser (tensors and byte entries), trainer state, random states, rollouts."""
    model, optimizer = _model_and_optimizer()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = torch.nn.Linear(3, 2)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    verify_checkpoint(str(ckpt))
    state = load_checkpoint(str(ckpt), modules={"m": fresh}, optimizer=fresh_optimizer)
    assert state == {"iteration": 1}
    assert all(torch.equal(fresh.state_dict()[k], saved[k]) for k in saved)
    assert fresh_optimizer.param_groups[0]["lr"] == 0.1
    assert torch.equal(fresh_optimizer.state[fresh.weight]["exp_avg"],
                       optimizer.state[model.weight]["exp_avg"])
    assert load_rng_state(str(ckpt))["torch"].dtype == torch.uint8
    (rollout,) = load_rollouts(str(ckpt))
    assert rollout["text"] == ["a", "b"] and rollout["tokens"].sum() == 15


@pytest.mark.parametrize("loader", ["verify_checkpoint", "load_checkpoint", "load_dcp"])
def test_planted_weights_metadata_is_refused(ckpt, marker, loader):
    """``load_dcp`` alone too: DCP takes a failed ``.metadata`` for an absent one and falls back
    to each process's own, so the refusal must not be lost there."""
    file = _plant_metadata(ckpt, marker)
    model = torch.nn.Linear(3, 2)
    call = {"verify_checkpoint": lambda: verify_checkpoint(str(ckpt)),
            "load_checkpoint": lambda: _load(ckpt),
            "load_dcp": lambda: load_dcp({"model": {"m." + k: v for k, v in
                                                    model.state_dict().items()}},
                                         str(ckpt / "weights"))}[loader]
    _refused(call, file, marker)


def test_planted_weights_metadata_of_another_type_is_refused(ckpt, marker):
    """Not hidden: the whole ``.metadata`` is the payload (what the issue's attack planted)."""
    file = ckpt / "weights" / ".metadata"
    file.write_bytes(pickle.dumps(_Payload(marker)))
    _resign_manifest(ckpt)
    _refused(lambda: _load(ckpt), file, marker)


def test_planted_byte_entry_of_the_weights_is_refused(ckpt, marker):
    file = _plant_byte_entry(ckpt, marker)
    _refused(lambda: _load(ckpt), file, marker)


@pytest.mark.parametrize("name", ["trainer.pt", "rng/rank_0.pt"])
def test_planted_trainer_and_rng_state_are_refused(ckpt, marker, name):
    file = _plant_torch_file(ckpt / name, marker)
    _refused(lambda: verify_checkpoint(str(ckpt)), file, marker)
    loader = load_trainer_state if name == "trainer.pt" else load_rng_state
    _refused(lambda: loader(str(ckpt)), file, marker)


def test_planted_rollout_is_refused(ckpt, marker):
    file = _plant_rollout(ckpt, marker)
    _refused(lambda: load_rollouts(str(ckpt)), file, marker)
    _refused(lambda: verify_checkpoint(str(ckpt)), file, marker)


def test_planted_critic_warm_start_is_refused(ckpt, marker):
    """``value_model.warm_start`` reads the weights' metadata before anything else."""
    file = _plant_metadata(ckpt, marker)
    _refused(lambda: load_critic(str(ckpt), critic=None), file, marker)


@pytest.fixture
def pickled_model_dir(tmp_path, marker) -> Path:
    """A model folder (a policy for ``evaluate``, a reward model) whose weights are a pickled
    ``pytorch_model.bin`` holding a payload."""
    from transformers import LlamaConfig

    folder = tmp_path / "model"
    tokenizer = byte_tokenizer()
    LlamaConfig(vocab_size=len(tokenizer), hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    torch.save({"model.embed_tokens.weight": _Payload(marker)}, folder / "pytorch_model.bin")
    return folder


@pytest.mark.parametrize("loader", [load_causal_lm, load_sequence_classifier],
                         ids=["policy", "reward-model"])
def test_planted_pickled_model_weights_are_refused(pickled_model_dir, marker, loader):
    """transformers reads a ``.bin`` with ``weights_only=True``: refused, in one line."""
    _refused(lambda: loader(str(pickled_model_dir)), pickled_model_dir / "pytorch_model.bin",
             marker)


def test_resume_auto_refuses_a_planted_metadata_in_one_line(tmp_path, tiny_llama_dir, marker,
                                                           capsys, monkeypatch):
    """``rlhf-torchrl ppo resume=auto``: the command prints one line naming the file and exits
    with status 1; the payload never runs."""
    settings = ["checkpoint.every=1", "ppo.num_iterations=1"]
    ppo.train(_cfg(tmp_path, tiny_llama_dir, *settings))
    (_, path), = list_checkpoints(str(tmp_path))
    file = _plant_metadata(Path(path), marker)
    cfg = _cfg(tmp_path, tiny_llama_dir, *settings, "ppo.num_iterations=2", "resume=auto")
    monkeypatch.delenv("RLHF_TORCHRL_TRACEBACK", raising=False)
    capsys.readouterr()  # (the first run's loading bars)
    with pytest.raises(SystemExit) as exited:
        cli.run(ppo.train, cfg)
    assert exited.value.code == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("Error: ") and str(file) in error[0]
    assert not marker.exists(), "the payload ran"
