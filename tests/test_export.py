"""``rlhf-torchrl export``: a checkpoint's policy as a Hugging Face model directory whose logits are
the trained policy's. One process and LoRA (merged, as adapters) here; FSDP2's shards of two
processes in tests/test_distributed.py (test_sharded_checkpoint_resumes_exactly); loading in vLLM
in tests/test_vllm.py."""

import shutil
from pathlib import Path

import pytest
import torch
from test_recipe import _cfg

from rlhf_torchrl import cli
from rlhf_torchrl.config.builders import build_trainer
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.modules.models import PLAIN_TEMPLATE
from rlhf_torchrl.trainers.checkpoint import list_checkpoints
from rlhf_torchrl.trainers.export import export_checkpoint

pytestmark = pytest.mark.xdist_group("export")  # the module's two runs, made once, on one worker


def logits(model, tokenizer) -> torch.Tensor:
    """The model's logits on three left-padded texts, (3, T, V)."""
    batch = tokenizer(["The film was", "I did not expect the ending", "Its story"],
                      return_tensors="pt", padding=True)
    with torch.no_grad():
        return model.eval()(**batch).logits


def _trained(tmp_path_factory, model_dir: str, name: str, *overrides: str):
    """(run directory, trained policy in memory) of a 2-iteration run with a checkpoint each."""
    out = tmp_path_factory.mktemp(name)
    trainer = build_trainer(_cfg(out, model_dir, "checkpoint.every=1", "logging.save_model=false",
                                 *overrides))
    trainer.fit()
    return out, trainer.actor.model


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_llama_dir):
    return _trained(tmp_path_factory, tiny_llama_dir, "full", "value_model.init=shared")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_llama_dir):
    pytest.importorskip("peft", reason="LoRA needs the [peft] extra")
    return _trained(tmp_path_factory, tiny_llama_dir, "lora", "lora.r=2", "value_model.init=policy",
                    "ppo.num_iterations=1")


def test_a_run_exports_its_newest_checkpoint_with_the_policys_logits(full_run, tiny_llama_dir,
                                                                      tokenizer, tmp_path, capsys):
    """Through the command: the run directory's newest checkpoint (said), every file transformers
    needs, the value head left out (said); the logits are the trained policy's to the bit (the
    same fp32 weights through the same forward)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, trained = full_run
    out = tmp_path / "hf"
    cli.main(["export", str(run), str(out)])
    said = capsys.readouterr().out.strip().splitlines()
    newest = list_checkpoints(str(run))[-1][1]
    assert len(said) == 1 and said[0].startswith(f"Exported {newest} (iteration 2, the newest")
    assert "; one process)" in said[0]
    assert said[0].endswith("Not exported: the value head, the optimiser state, the trainer's state.")
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= files
    assert not any(p.name.startswith(".hf.tmp") for p in tmp_path.iterdir())
    exported = AutoModelForCausalLM.from_pretrained(out)
    saved = AutoTokenizer.from_pretrained(out)  # the run's: its pad token, left padding, template
    want = logits(trained, tokenizer)
    assert torch.equal(logits(exported, saved), want)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert (logits(base, tokenizer) - want).abs().max() > 1e-3  # the run did change the policy
    assert saved.padding_side == "left" and saved.pad_token_id == exported.config.pad_token_id
    assert saved.chat_template == PLAIN_TEMPLATE  # the preset's data.chat_template=plain, as trained


def test_lora_exports_merged_and_as_adapters(lora_run, tiny_llama_dir, tokenizer, tmp_path):
    """Merged: a plain model, equal to fp32 rounding (W + s B A times x is summed in another order
    than W x + s B (A x)). Adapters: PEFT's directory on the base model, equal to the bit."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run, trained = lora_run
    want = logits(trained, tokenizer)
    merged = export_checkpoint(str(run), str(tmp_path / "merged"))
    assert merged.lora == "merge" and "the critic's own trunk" in merged.left_out
    assert "model.safetensors" in merged.files and "adapter_config.json" not in merged.files
    got = logits(AutoModelForCausalLM.from_pretrained(merged.path), tokenizer)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # (measured: 2e-7 at logits < 1)
    adapters = export_checkpoint(str(run), str(tmp_path / "adapters"), lora="adapters")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(adapters.files)
    assert "model.safetensors" not in adapters.files  # the adapters only
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert (logits(base, tokenizer) - want).abs().max() > 1e-4  # the adapters are not a no-op
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama_dir),
                                           adapters.path)
    assert torch.equal(logits(peft_model, tokenizer), want)


def test_bad_input_is_one_line_before_any_model_loads(full_run, tmp_path, monkeypatch, capsys):
    from rlhf_torchrl.modules import models

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(models, "load_causal_lm", no_loading)
    monkeypatch.setattr(models, "load_tokenizer", no_loading)
    run, _ = full_run
    full = tmp_path / "taken"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    (tmp_path / "empty").mkdir()
    (tmp_path / "finished" / "policy").mkdir(parents=True)
    (tmp_path / "finished" / "policy" / "config.json").write_text("{}")
    checkpoint = list_checkpoints(str(run))[-1][1]
    cases = [
        ((str(run), str(full)), {}, "is not empty"),
        ((str(tmp_path / "nowhere"), str(tmp_path / "a")), {}, "does not exist"),
        ((str(tmp_path / "empty"), str(tmp_path / "a")), {}, "neither a checkpoint"),
        ((str(tmp_path / "finished"), str(tmp_path / "a")), {}, "is the final policy"),
        ((checkpoint, str(tmp_path / "a")), {"lora": "adapters"}, "trained without LoRA"),
        ((checkpoint, str(tmp_path / "a")), {"lora": "both"}, "not an export mode"),
        ((checkpoint, str(tmp_path / "a")), {"base": str(tmp_path / "gone")}, "--base"),
    ]
    for args, kwargs, words in cases:
        with pytest.raises(ConfigError, match=words) as raised:
            export_checkpoint(*args, **kwargs)
        assert "\n" not in str(raised.value)
    assert not (tmp_path / "a").exists()
    monkeypatch.delenv("RLHF_TORCHRL_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as exited:
        cli.main(["export", str(run), str(full)])
    error = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 1 and len(error) == 1 and error[0].startswith("Error: Output folder")


def test_a_planted_checkpoint_is_refused_and_nothing_in_it_runs(full_run, tmp_path):
    from test_checkpoint_safety import _plant_metadata, _refused

    run, _ = full_run
    checkpoint = Path(shutil.copytree(list_checkpoints(str(run))[-1][1], tmp_path / "iter"))
    marker = tmp_path / "code_ran"
    file = _plant_metadata(checkpoint, marker)
    _refused(lambda: export_checkpoint(str(checkpoint), str(tmp_path / "out")), file, marker)
