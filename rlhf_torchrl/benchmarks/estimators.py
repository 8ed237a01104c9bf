"""PPO (GAE) against GRPO, RLOO and REINFORCE++ on a task preset, at the same responses per
iteration: each seed x estimator a full ``rlhf-torchrl ppo`` run of its own process, one at a time,
its peak RSS taken from the kernel. A run whose ``report.json`` exists is skipped, so the command
resumes where it stopped; at the end it prints :mod:`.estimators_table`'s table of the runs.

GAE runs the preset as it is (its prompts x 1 response); GRPO and RLOO take 4 responses per
prompt (a quarter of the prompts); REINFORCE++ one. Each run writes ``<out>/<task>_<estimator>
[_<tag>]_<seed>/`` (``report.json``: the held-out figures, ``final_kl``, ``seconds_per_iteration``),
its output to ``.log`` beside it, and its peak RSS to ``.time`` (as ``/usr/bin/time -v`` words it).
``--extra`` adds overrides to every run (a variant, named by ``--tag``)::

    rlhf-torchrl bench estimators --task arithmetic --seeds 0 1 2
    rlhf-torchrl bench estimators --task sentiment --estimators gae --extra model.autocast=bfloat16 --tag bf16
"""

from __future__ import annotations

import os
import subprocess
import sys

from rlhf_torchrl.benchmarks.common import add_out_arg, make_parser
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.objectives.advantages import ADVANTAGE_ESTIMATORS

#: the registered estimators, in the order they run
ESTIMATORS = tuple(ADVANTAGE_ESTIMATORS)
#: the responses per prompt of the estimators that compare a prompt's responses
GROUP_SIZE = 4


def settings(estimator: str) -> list[str]:
    """The overrides of an estimator's runs: the estimator, and groups of :data:`GROUP_SIZE`
    where it compares responses to the same prompt."""
    groups = ADVANTAGE_ESTIMATORS.get(estimator).compares_groups
    return [f"advantage.estimator={estimator}",
            *([f"generation.samples_per_prompt={GROUP_SIZE}"] if groups else [])]

#: no checkpoints and no saved policy (3.8 GB a SmolLM2 run): the figures are in report.json
RUN_SETTINGS = ["logging.progress_bar=false", "resume=never", "checkpoint.every=0",
                "logging.save_model=false"]


def run_name(task: str, estimator: str, seed: int, tag: str = "") -> str:
    """A run's folder name, as :mod:`.estimators_table` finds it."""
    return f"{task}_{estimator}{'_' + tag if tag else ''}_{seed}"


def command(task: str, estimator: str, seed: int, run_dir: str, extra: list[str]) -> list[str]:
    """The ``rlhf-torchrl ppo`` command of one run, through this interpreter."""
    return [sys.executable, "-c", "from rlhf_torchrl.cli import main; main()", "ppo",
            f"task={task}", f"seed={seed}", *settings(estimator), *extra, f"output_dir={run_dir}",
            f"hydra.run.dir={run_dir}", *RUN_SETTINGS]


def run(cmd: list[str], log_path: str, time_path: str) -> int:
    """Run ``cmd`` with its output in ``log_path``; its peak RSS (the kernel's, of that process and
    its children) to ``time_path``. Returns its exit status."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    with open(time_path, "w") as f:  # ru_maxrss: kilobytes on Linux
        f.write(f"\tMaximum resident set size (kbytes): {usage.ru_maxrss}\n"
                f"\tExit status: {process.returncode}\n")
    return process.returncode


def main(argv=None) -> list[str]:
    parser = make_parser(__doc__)
    parser.add_argument("--task", default="arithmetic", help="the task preset (task=...)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--estimators", nargs="+", default=list(ESTIMATORS), choices=ESTIMATORS)
    parser.add_argument("--runs", default="outputs/estimators", help="the folder the runs go to")
    parser.add_argument("--extra", nargs="*", default=[],
                        help="overrides added to every run, e.g. model.autocast=bfloat16 (needs --tag)")
    parser.add_argument("--tag", default="", help="the variant's name in its runs' names")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the commands of the runs still to do, run nothing")
    add_out_arg(parser)  # the table's figures (estimators_table --out)
    args = parser.parse_args(argv)
    if args.extra and not args.tag:
        raise ConfigError("--extra needs --tag: the variant's runs need names of their own "
                          "(--tag bf16 ...).")
    os.makedirs(args.runs, exist_ok=True)
    todo = []
    for seed in args.seeds:
        for estimator in args.estimators:
            run_dir = os.path.join(args.runs, run_name(args.task, estimator, seed, args.tag))
            if not os.path.exists(os.path.join(run_dir, "report.json")):
                todo.append((run_dir, command(args.task, estimator, seed, run_dir, args.extra)))
    for run_dir, cmd in todo:
        print(" ".join(cmd[4:]) if args.dry_run else f"running {run_dir}", flush=True)
        if not args.dry_run and run(cmd, run_dir + ".log", run_dir + ".time"):
            print(f"failed: {run_dir} (see {run_dir}.log)", flush=True)
    if not args.dry_run:
        from rlhf_torchrl.benchmarks import estimators_table

        estimators_table.main(["--task", args.task, "--runs", args.runs, "--estimators",
                               *args.estimators, *(["--tag", args.tag] if args.tag else []),
                               *(["--out", args.out] if args.out else [])])
    return [run_dir for run_dir, _ in todo]


if __name__ == "__main__":
    main()
