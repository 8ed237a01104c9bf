"""The ``rlhf-torchrl`` command: PPO, reward-model training, evaluation, reports, benchmarks.

    rlhf-torchrl ppo                                   # the offline default task
    rlhf-torchrl ppo task=arithmetic ppo.batch_size=16 # Hydra overrides pass through
    rlhf-torchrl reward-model data.source=pairs.jsonl
    rlhf-torchrl serve-reward-model model=<dir or id> port=8000  # PPO elsewhere: reward.remote_url
    rlhf-torchrl evaluate model.policy=outputs/ppo/<run>/policy
    rlhf-torchrl report outputs/ppo/<run>
    rlhf-torchrl export outputs/ppo/<run> exported/    # a Hugging Face model folder (transformers, vLLM)
    rlhf-torchrl bench ppo_iteration                   # a benchmark (`bench --help`: all)
    rlhf-torchrl ppo --help                            # config groups and the most used settings

User errors (bad settings, data, a guard that stopped the run) print one line, ``Error: ...``, and
exit with status 1; internal errors keep their traceback.
"""

from __future__ import annotations

import errno
import os
import signal
import sys

from rlhf_torchrl.collectors.on_policy import OffPolicyError
from rlhf_torchrl.distributed import PeerLost
from rlhf_torchrl.errors import ConfigError, DiskFullError, SamplerError
from rlhf_torchrl.rewards.scoring import RewardError
from rlhf_torchrl.trainers.guards import DivergenceError

#: errors that explain themselves: bad settings, data, files or packages (ConfigError and its
#: kin), a reward that fails, the guards that stop a run, a sampler lost past its restarts, a full
#: disk while a checkpoint is written.
#: Anything else is a bug: traceback.
USER_ERRORS = (ConfigError, RewardError, DivergenceError, OffPolicyError, SamplerError,
               DiskFullError)


def run(fn, cfg):
    """``fn(cfg)``; a :data:`USER_ERRORS` error is a message about the input or the run, not
    about this code: printed as ``Error: ...``, exit status 1 (``RLHF_TORCHRL_TRACEBACK=1``
    re-raises it with its traceback)."""
    from rlhf_torchrl.trainers.interrupt import RunInterrupted

    quiet_third_party_bars()
    try:
        return fn(cfg)
    except USER_ERRORS as error:
        if os.environ.get("RLHF_TORCHRL_TRACEBACK"):
            raise
        print(f"Error: {error}", file=sys.stderr, flush=True)
        sys.exit(1)
    except RunInterrupted as stop:  # Ctrl-C or SIGTERM: a checkpoint, and the command that goes on
        if os.environ.get("RLHF_TORCHRL_TRACEBACK"):
            raise
        print(stop.message, file=sys.stderr, flush=True)
        sys.exit(stop.exit_status)
    except KeyboardInterrupt:  # before the first iteration or after the last: nothing to resume
        if os.environ.get("RLHF_TORCHRL_TRACEBACK"):
            raise
        print("Stopped by Ctrl-C outside the training iterations (while loading, or while the "
              "final policy and report were written): run the command again; with resume=auto "
              "it continues from the newest checkpoint, if any.", file=sys.stderr, flush=True)
        sys.exit(130)
    except OSError as error:  # a full disk while writing metrics, samples or the policy: one line
        if error.errno not in (errno.ENOSPC, errno.EDQUOT) or os.environ.get("RLHF_TORCHRL_TRACEBACK"):
            raise
        print(f"Error: the disk filled while the run wrote {error.filename or 'a file'} "
              f"({os.strerror(error.errno)}). The checkpoints are whole (each is written to a "
              "temporary folder, then renamed): make room, then run the same command again; "
              "resume=auto continues from the newest.", file=sys.stderr, flush=True)
        sys.exit(1)
    except PeerLost as error:  # another torchrun process died: one line, not the collective's
        if os.environ.get("RLHF_TORCHRL_TRACEBACK"):
            raise
        print(f"Error: {error}", file=sys.stderr, flush=True)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # (held back since: now)
        sys.exit(1)


def quiet_third_party_bars() -> None:
    """No loading bars from transformers (weights, GGUF dequantising) or the hub: a run's own
    progress is the only bar, and a log file gets no carriage returns."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    disable_progress_bars()


#: the settings ``rlhf-torchrl ppo --help`` shows, by the question they answer
MOST_USED = {
    "what to train": ["model.policy", "model.reference", "value_model.init", "lora.r"],
    "on what": ["data.source", "data.column", "data.template", "data.limit",
                "data.max_prompt_length"],
    "rewarded how": ["reward.model", "reward.functions", "reward.missing_eos_penalty"],
    "sampling": ["generation.backend", "generation.max_new_tokens", "generation.temperature",
                 "generation.samples_per_prompt", "env.max_turns", "env.tools", "collection.overlap"],
    "PPO": ["ppo.num_iterations", "ppo.batch_size", "ppo.num_mini_batches", "ppo.num_ppo_epochs",
            "advantage.estimator", "ppo.kl_coef", "ppo.kl_loss_coef", "ppo.kl_target", "optim.lr",
            "optim.critic_warmup"],
    "run": ["seed", "output_dir", "resume", "device", "model.autocast", "checkpoint.every",
            "eval.every", "eval.samples_per_prompt", "eval.source", "logging.logger"],
}


def check_task(args: list[str]) -> None:
    """An unknown ``task=`` preset: one line naming the presets, exit status 1 (Hydra would
    print its config search path)."""
    from rlhf_torchrl.config import tasks

    for arg in args:
        if arg.startswith(("task=", "+task=", "++task=")):
            name = arg.split("=", 1)[1]
            if name not in tasks():
                print(f"Error: task={name} is not a task preset: choose one of "
                      f"{', '.join(tasks())} (task=custom takes your own data and reward).",
                      file=sys.stderr, flush=True)
                sys.exit(1)


def check_overrides(args: list[str], config_name: str = "rlhf_ppo", command: str = "ppo") -> None:
    """An unknown ``task=``, an unknown key or a value of the wrong type among the overrides
    ``args``: one line naming the key and the fix, exit status 1 (Hydra would print its error, the
    cause over five lines and a hint about HYDRA_FULL_ERROR). Any other error is Hydra's to
    report, as are the overrides of another config (``--config-dir`` and kin)."""
    check_task(args)
    if any(a.startswith(("--config-", "-cp", "-cn", "-cd")) for a in args):
        return
    overrides = [a for a in args if "=" in a and not a.startswith(("-", "hydra.", "hydra/", "+hydra", "++hydra"))]
    if not overrides:
        return
    from rlhf_torchrl.config import compose

    try:
        compose(overrides, config_name)
    except Exception as error:  # noqa: BLE001 - Hydra's; override_error reads the ones it knows
        message = override_error(error, command)
        if message is not None:
            print(f"Error: {message}", file=sys.stderr, flush=True)
            sys.exit(1)


def override_error(error: Exception, command: str = "ppo") -> str | None:
    """The one line for a Hydra composition ``error`` whose cause is an unknown key or a value of
    the wrong type (OmegaConf's, with ``full_key``), naming the key and the fix; None otherwise."""
    import dataclasses
    import difflib
    import typing

    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    cause = error.__cause__
    key, schema = getattr(cause, "full_key", None), getattr(cause, "object_type", None)
    if not key:
        return None
    leaf = key.rpartition(".")[2]
    listing = f"`rlhf-torchrl {command} --cfg job` prints every setting"
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        names = [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else []
        if "." not in key and command in ("ppo", "evaluate"):
            names.append("task")  # the config group (task=NAME)
        close = difflib.get_close_matches(leaf, names, n=1)
        hint = f"did you mean {key[:-len(leaf)]}{close[0]}? " if close else "check its spelling; "
        return f"{key} is not a setting: {hint}{listing}."
    if isinstance(cause, ValidationError):
        try:
            expected = typing.get_type_hints(schema)[leaf]
        except (KeyError, TypeError, NameError):
            return None
        kind = _kind(expected)
        if kind is None:
            return None
        if kind == "group":
            return (f"{key}={_shown(cause.value)}: {key} is a group of settings, not a value: set "
                    f"its keys one by one ({key}.<key>=...); {listing}.")
        from omegaconf import OmegaConf

        parent = getattr(cause, "parent_node", None)
        now = OmegaConf.select(parent, leaf) if OmegaConf.is_config(parent) else None
        example = f", e.g. {key}={_shown(now)} (its value now)" if now is not None else ""
        return f"{key}={_shown(cause.value)} is not {kind}: give {kind}{example}."
    return None


def _shown(value) -> str:
    """``value`` as an override writes it (``true``, ``null``, ``[a,b]``)."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, list):
        return "[" + ",".join(_shown(v) for v in value) + "]"
    return str(value)


def _kind(hint) -> str | None:
    """What a setting of type ``hint`` takes, in words ("an integer", "an integer or null");
    "group" for a group of settings; None for a type this does not describe."""
    import dataclasses
    import types
    import typing

    args = typing.get_args(hint)
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        rest = [a for a in args if a is not type(None)]
        hint = rest[0] if len(rest) == 1 else None
    if dataclasses.is_dataclass(hint):
        return "group"
    origin = typing.get_origin(hint)
    words = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
             list: "a list", dict: "a mapping"}.get(origin or hint)
    if words is None:
        return None
    return f"{words} or null" if optional else words


def with_run_dir(args: list[str]) -> list[str]:
    """``args`` with ``hydra.run.dir`` set to the ``output_dir=`` among them (unless it is set
    itself): Hydra's own files (``.hydra/``, the job's log) then go under the run's output
    directory, and nothing is written in the working directory. Without ``output_dir=`` Hydra's
    run directory is the output directory (``outputs/<command>/...``)."""
    if any(a.lstrip("+").startswith("hydra.run.dir=") for a in args):
        return list(args)
    given = [a.split("=", 1)[1] for a in args if a.lstrip("+").startswith("output_dir=")]
    return [*args, f"hydra.run.dir={given[-1]}"] if given else list(args)


def _hydra_app(fn, config_name: str, job: str, args: list[str]) -> None:
    """Run ``fn(cfg)`` as the Hydra app of config ``config_name`` over ``args`` (overrides and
    Hydra's own flags: ``--cfg job``, ``--multirun``, ``hydra.run.dir=...``)."""
    import hydra

    from rlhf_torchrl import config  # noqa: F401 - registers the configs

    check_overrides(args, config_name, job.replace("_", "-"))

    @hydra.main(config_path=None, config_name=config_name, version_base=None)
    def app(cfg) -> None:
        run(fn, cfg)

    sys.argv = [f"rlhf-torchrl {job}", f"hydra.job.name={job}", *with_run_dir(args)]
    app()


def registered_lines(cfg) -> list[str]:
    """What each registry holds (:mod:`rlhf_torchrl.registry`), the config's ``plugins`` imported
    first: one line per entry, under the setting that selects it."""
    from omegaconf import OmegaConf

    import rlhf_torchrl.collectors.backends  # noqa: F401 - the built-in entries register
    import rlhf_torchrl.objectives.advantages  # noqa: F401
    import rlhf_torchrl.objectives.policy_losses  # noqa: F401
    import rlhf_torchrl.rewards.kinds  # noqa: F401
    from rlhf_torchrl.registry import REGISTRIES, load_plugins

    plugins = load_plugins(OmegaConf.select(cfg, "plugins", default=None))
    lines = [f"registered (rlhf_torchrl.registry{'; plugins: ' + ', '.join(plugins) if plugins else ''}; "
             "add your own with plugins=[my_pkg.module]):", ""]
    for setting, registry in REGISTRIES.items():
        lines.append(f"{setting}:")
        for name, doc in registry.describe():
            doc = doc if len(doc) <= 72 else doc[:69].rsplit(" ", 1)[0] + " ..."
            lines.append(f"  {name}".ljust(20) + f"  {doc}")
        lines.append("")
    return lines


def _ppo_help(overrides: list[str]) -> str:
    """The settings of ``rlhf-torchrl ppo [overrides] --help``: with ``task=...`` that task's."""
    from omegaconf import OmegaConf

    from rlhf_torchrl.config import compose, setting_docs, tasks

    overrides = [o for o in overrides if "=" in o and not o.startswith(("hydra.", "output_dir="))]
    try:
        cfg = compose([*overrides, "output_dir=outputs/ppo/TASK/DATE"])
    except Exception as error:  # noqa: BLE001 - Hydra's own: a bad override
        lines = [str(e).strip().splitlines()[0] for e in (error, error.__cause__) if e is not None]
        print(f"Error: {override_error(error) or ' '.join(lines)}", file=sys.stderr)
        sys.exit(1)
    task = next((o.split("=", 1)[1] for o in overrides if o.startswith("task=")), "sentiment")
    docs = setting_docs()
    lines = ["usage: rlhf-torchrl ppo [KEY=VALUE ...] [--cfg job] [--multirun]", "",
             "PPO-RLHF: the package's trainer over the Hydra config (every setting: --cfg job).", "",
             "config groups:",
             f"  task={'|'.join(tasks())}   (default: sentiment) data, rewards and settings of a task",
             "", f"most used settings, with their values under task={task} "
             "(`rlhf-torchrl ppo task=NAME --help` for another):", ""]
    for title, keys in MOST_USED.items():
        lines.append(f"{title}:")
        for key in keys:
            value = OmegaConf.select(cfg, key)
            value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
            shown = "null" if value is None else value
            doc = docs.get(key, "")
            doc = doc if len(doc) <= 72 else doc[:69].rsplit(" ", 1)[0] + " ..."
            lines.append(f"  {key}={shown}".ljust(40) + f"  {doc}")
        lines.append("")
    lines += registered_lines(cfg)
    lines += ["examples:",
              "  rlhf-torchrl ppo task=arithmetic ppo.batch_size=16",
              "  rlhf-torchrl ppo model.policy=Qwen/Qwen2.5-0.5B-Instruct task=gsm8k device=cuda",
              "  torchrun --nproc_per_node=2 -m rlhf_torchrl.cli ppo distributed.strategy=fsdp2"]
    return "\n".join(lines)


def _ppo(args: list[str]) -> None:
    from rlhf_torchrl.config.builders import train

    _hydra_app(train, "rlhf_ppo", "ppo", args)


def _reward_model(args: list[str]) -> None:
    from rlhf_torchrl.config.reward_model import train_reward_model

    _hydra_app(train_reward_model, "rlhf_reward_model", "reward_model", args)


def _serve_reward_model(args: list[str]) -> None:
    from rlhf_torchrl.config.serve_reward_model import serve_reward_model

    _hydra_app(serve_reward_model, "rlhf_serve_reward_model", "serve_reward_model", args)


def _evaluate(args: list[str]) -> None:
    from rlhf_torchrl.config.evaluate_policy import evaluate_policy, evaluation_args

    # outputs/evaluate/<date>_<policy>/, not a training run's folder (unless output_dir=...)
    _hydra_app(evaluate_policy, "rlhf_ppo", "evaluate", evaluation_args(args))


def _report(args: list[str]) -> None:
    from rlhf_torchrl.record.report_command import main

    run(lambda a: main(a, prog="rlhf-torchrl report"), args)  # not a run directory: one line


def _export(args: list[str]) -> None:
    from rlhf_torchrl.trainers.export import main as export_main

    run(export_main, args)  # not a checkpoint, a folder not empty: one line


def _bench(args: list[str]) -> None:
    """``rlhf_torchrl.benchmarks.<name>.main(args)``: no clone needed."""
    import importlib

    from rlhf_torchrl.benchmarks import BENCHMARKS

    usage = "usage: rlhf-torchrl bench NAME [--help] [options]"
    if not args or args[0] in ("-h", "--help"):
        print(f"{usage}\n\nbenchmarks:")
        for name, text in BENCHMARKS.items():
            print(f"  {name:<18}{text}")
        print("\n`rlhf-torchrl bench NAME --help` for its options and their defaults.")
        return
    name = args[0].replace("-", "_")
    if name not in BENCHMARKS:
        print(f"{usage}\nError: no benchmark {args[0]!r}: choose one of {', '.join(BENCHMARKS)}.",
              file=sys.stderr)
        sys.exit(2)
    module = importlib.import_module(f".benchmarks.{name}", __package__)
    sys.argv = [f"rlhf-torchrl bench {name}", *args[1:]]  # argparse's prog, in --help and errors
    run(module.main, args[1:])


def _plan(args: list[str]) -> None:
    from rlhf_torchrl.plan import main as plan_main

    check_overrides(args)  # a typo, a wrong type or an unknown task: one line, as ppo says it
    run(plan_main, args)


COMMANDS = {
    "ppo": (_ppo, "train a policy with PPO (Hydra overrides: task=arithmetic ppo.batch_size=16)"),
    "reward-model": (_reward_model, "train a reward model on preference pairs (Bradley-Terry)"),
    "serve-reward-model": (_serve_reward_model, "serve a reward model over HTTP for runs elsewhere "
                                                "(model=<dir or id> port=8000)"),
    "evaluate": (_evaluate, "evaluate a saved policy on the held-out prompts or every prompt of "
                            "a file (eval.source=...): eval.json and report.html"),
    "report": (_report, "write report.html for a run directory, or one page overlaying several"),
    "export": (_export, "write a checkpoint's policy as a Hugging Face model folder that "
                        "transformers and vLLM load (LoRA merged or as adapters)"),
    "bench": (_bench, "run a benchmark (`rlhf-torchrl bench --help` lists them)"),
    "plan": (_plan, "a run's memory per device and time per phase, before any weight loads "
                    "(the PPO overrides; --gpu H100 --world-size 8)"),
}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: rlhf-torchrl {" + ",".join(COMMANDS) + "} [args ...]\n\n"
              "PPO-RLHF for language models as a composable TorchRL pipeline.\n\ncommands:")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:<20}{text}")
        print("\n`rlhf-torchrl <command> --help` for its settings.")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nError: unknown command {argv[0]!r}.", file=sys.stderr)
            sys.exit(2)
        return
    command, args = argv[0], argv[1:]
    if command == "ppo" and any(a in ("-h", "--help") for a in args):
        check_task(args)
        print(_ppo_help(args))
        return
    COMMANDS[command][0](args)


if __name__ == "__main__":
    main()
