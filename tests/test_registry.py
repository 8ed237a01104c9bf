"""Registries: config names resolve through them, a plugin's entries become settings by being
imported, and capabilities are properties of the registered object, never a name compared."""

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlhf_torchrl.collectors.backends import GENERATION_BACKENDS, GenerationBackend
from rlhf_torchrl.collectors.on_policy import log_probs_from_sampling
from rlhf_torchrl.config import compose
from rlhf_torchrl.config.checks import check_config
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.objectives.advantages import ADVANTAGE_ESTIMATORS, make_advantage
from rlhf_torchrl.registry import Registry, load_plugins

ROOT = Path(__file__).resolve().parents[1]

PLUGIN = '''
"""A user's extension: an estimator, a policy loss, a backend and a reward kind, each registered."""
from rlhf_torchrl.collectors.backends import GENERATION_BACKENDS, GenerationBackend
from rlhf_torchrl.objectives.advantages import ADVANTAGE_ESTIMATORS, RLOOAdvantage
from rlhf_torchrl.objectives.policy_losses import POLICY_LOSSES, PolicyLoss
from rlhf_torchrl.rewards.kinds import REWARD_KINDS, RewardKind


@ADVANTAGE_ESTIMATORS.register("halved_rloo")
class HalvedRLOO(RLOOAdvantage):
    """RLOO, halved."""

    def __init__(self, *, gamma: float = 1.0):
        super().__init__()
        self.gamma = gamma

    def forward(self, td):
        td = super().forward(td)
        td.set("advantage", td.get("advantage") / 2)
        return td


@POLICY_LOSSES.register("ext_plain_pg")
class PlainPG(PolicyLoss):
    """The unclipped surrogate -r A."""

    supports_dual_clip = False

    def per_token(self, inputs):
        return -inputs.log_weight.exp() * inputs.advantage, {}


@GENERATION_BACKENDS.register("echo")
class Echo(GenerationBackend):
    """A backend that takes pushed weights."""

    takes_pushed_weights = True
    recheck_after_push = True


@REWARD_KINDS.register("length")
class Length(RewardKind):
    """len:<n>: the response's length up to n characters."""

    @classmethod
    def matches(cls, spec):
        return spec.startswith("len:")

    @classmethod
    def short_name(cls, spec):
        return "length"

    @classmethod
    def build(cls, spec, name, cfg):
        cap = int(spec.split(":", 1)[1])
        return lambda prompts, responses: [float(min(len(r), cap)) for r in responses]
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "my_rl_ext.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rl_ext"
    for registry, name in ((ADVANTAGE_ESTIMATORS, "halved_rloo"), (GENERATION_BACKENDS, "echo")):
        registry._entries.pop(name, None)
    from rlhf_torchrl.objectives.policy_losses import POLICY_LOSSES
    from rlhf_torchrl.rewards.kinds import REWARD_KINDS

    POLICY_LOSSES._entries.pop("ext_plain_pg", None)
    REWARD_KINDS._entries.pop("length", None)
    sys.modules.pop("my_rl_ext", None)


def test_a_registry_resolves_names_and_refuses_others_in_one_line():
    reg = Registry("my.setting", "widget")
    try:
        @reg.register("a")
        class A:
            """The first widget. More text."""

        assert reg.get("a") is A and A.name == "a" and "a" in reg and list(reg) == ["a"]
        assert reg.describe() == [("a", "The first widget")]
        with pytest.raises(ValueError, match="widget 'a' is registered already"):
            reg.register("a")(type("B", (), {}))
        with pytest.raises(ConfigError, match=r"^my.setting='b' is not a registered widget: choose "
                                              r"one of a, or register your own .*plugins=\[\.\.\.\]"):
            reg.get("b")
    finally:
        from rlhf_torchrl.registry import REGISTRIES

        REGISTRIES.pop("my.setting")


def test_a_plugin_registers_entries_that_the_config_selects(plugin, tiny_llama_dir, tmp_path):
    cfg = compose([f"plugins=[{plugin}]", "advantage.estimator=halved_rloo",
                   "generation.samples_per_prompt=2", "ppo.policy_loss=ext_plain_pg",
                   "reward.functions=[len:5]", f"model.policy={tiny_llama_dir}",
                   f"output_dir={tmp_path / 'run'}"])
    check_config(cfg)  # imports the plugin, then its names are choices
    estimator = make_advantage("halved_rloo", gamma=0.5, lmbda=0.9)
    assert type(estimator).__name__ == "HalvedRLOO" and estimator.gamma == 0.5
    assert estimator.compares_groups and not estimator.needs_critic  # inherited capabilities
    from rlhf_torchrl.config.components import make_reward_functions

    rewards = make_reward_functions(cfg)
    assert list(rewards) == ["length"] and rewards["length"][0]([""], ["abcdefgh"]) == [5.0]
    # a capability is the backend's attribute: a pushed-weights backend never records old log-probs
    assert not log_probs_from_sampling(backend="echo")
    assert log_probs_from_sampling(backend="transformers")


def test_a_missing_plugin_is_one_line():
    with pytest.raises(ConfigError, match=r"^plugins: module 'no_such_ext\.rl' cannot be imported"):
        load_plugins(["no_such_ext.rl"])


def test_an_unregistered_name_is_refused_before_any_model_loads(tmp_path):
    cfg = compose(["advantage.estimator=vtrace", f"output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"advantage.estimator='vtrace' is not a registered "
                                          r"advantage estimator: choose one of gae, grpo, rloo, reinforce_pp"):
        check_config(cfg)


def test_ppo_help_lists_what_is_registered_with_the_plugins(plugin, tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-m", "rlhf_torchrl.cli", "ppo", f"plugins=[{plugin}]",
                          "--help"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    for line in ("advantage.estimator:", "  halved_rloo", "ppo.policy_loss:", "  gspo", "  cispo",
                 "  clip_cov", "  kl_cov", "  ext_plain_pg", "generation.backend:", "  vllm", "  echo",
                 "reward.functions:", "  length", "plugins: my_rl_ext"):
        assert line in out.stdout, line


def test_no_capability_is_a_name_compared():
    """No module compares a backend, estimator or policy-loss name to a literal: each question is
    an attribute of the registered object (the registries' own files aside)."""
    offenders = []
    for path in (ROOT / "rlhf_torchrl").rglob("*.py"):
        if "benchmarks" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            names = [ast.unparse(n) for n in (node.left, *node.comparators)]
            literal = any(isinstance(n, ast.Constant) and isinstance(n.value, str)
                          for n in (node.left, *node.comparators))
            if literal and any(n.endswith(("backend", ".estimator", "policy_loss")) for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, textwrap.indent("\n".join(offenders), "  ")


def test_each_backend_answers_every_capability():
    for name, backend in GENERATION_BACKENDS.items():
        assert issubclass(backend, GenerationBackend), name
        for attr in ("log_probs_match_training", "takes_pushed_weights", "recheck_after_push",
                     "samples_with_trained_model", "compiles_decode", "overlap_needs_policy_copy"):
            assert isinstance(getattr(backend, attr), bool), (name, attr)
    assert GENERATION_BACKENDS.get("vllm").recheck_after_push
    assert not GENERATION_BACKENDS.get("transformers").takes_pushed_weights
