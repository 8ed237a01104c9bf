"""Load on a served reward model: N concurrent clients, each sending requests one after another.

``rlhf-torchrl serve-reward-model`` runs in a process of its own (as it would on its own machine);
for each client count, every client posts ``--requests`` requests of ``--responses`` responses
(a one-turn conversation each, ``--words`` words long) and waits for each answer. Reported, not
asserted: each request's latency (p50, p99), requests and responses scored per second, and how
many texts the server scored per round (its batching across callers, from ``/health``).

    OMP_WAIT_POLICY=PASSIVE rlhf-torchrl bench reward_server --clients 1 4 16 --out r.json
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
import time
import urllib.request

from rlhf_torchrl.benchmarks.common import add_out_arg, finish, machine, make_parser, table
from rlhf_torchrl.http_client import post_json
from rlhf_torchrl.rewards.server import ServerProcess


def _request(responses: int, words: int, seed: int) -> bytes:
    """A request body of ``responses`` one-turn conversations of ``words`` words each."""
    vocabulary = ["good", "film", "plot", "slow", "great", "acting", "boring", "ending", "music"]
    rows = [" ".join(vocabulary[(seed + i * 7 + j) % len(vocabulary)] for j in range(words))
            for i in range(responses)]
    prompts = [f"Review {seed}-{i}:" for i in range(responses)]
    return json.dumps({"prompts": prompts, "responses": rows, "has_stop": [True] * responses,
                       "messages": [[{"role": "user", "content": p}] for p in prompts]}).encode()


def _classifier(name: str, folder: str) -> str:
    """``name``, or for the packaged MiniLM (an encoder without a head) a one-label classifier of
    it with a seeded head, saved in ``folder``."""
    from rlhf_torchrl.modules.models import MINILM, load_sequence_classifier

    if name != MINILM:
        return name
    import torch

    torch.manual_seed(0)
    model, tokenizer = load_sequence_classifier(name)
    path = os.path.join(folder, "minilm-classifier")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _health(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/health", timeout=30) as answer:
        return json.loads(answer.read())


def measure(url: str, clients: int, requests: int, responses: int, words: int) -> dict:
    """One load level: ``clients`` threads, each ``requests`` requests in a row."""
    latencies, errors = [], []
    before = _health(url)

    def client(c: int) -> None:
        for r in range(requests):
            body = _request(responses, words, seed=c * requests + r)
            start = time.perf_counter()
            try:
                post_json(f"{url}/score", body, attempts=1, timeout=300)
            except Exception as error:  # noqa: BLE001 - counted and reported, not raised
                errors.append(str(error))
                continue
            latencies.append(time.perf_counter() - start)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    after = _health(url)
    rounds = after["rounds"] - before["rounds"]
    ordered = sorted(latencies)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")  # noqa: E731
    return {"clients": clients, "requests": len(latencies), "errors": len(errors),
            "p50_ms": 1000 * (statistics.median(ordered) if ordered else float("nan")),
            "p99_ms": 1000 * pick(0.99), "requests_per_s": len(latencies) / wall,
            "responses_per_s": len(latencies) * responses / wall,
            "texts_per_round": (after["texts"] - before["texts"]) / rounds if rounds else 0.0,
            "seconds": wall}


def main(argv: list[str] | None = None) -> dict:
    parser = make_parser(__doc__)
    parser.add_argument("--model", default="all-minilm-l6-v2",
                        help="the served reward model (a directory, a hub id or the packaged "
                             "all-minilm-l6-v2, given a fresh one-label head: figures of speed)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16],
                        help="concurrent clients, one load level each")
    parser.add_argument("--requests", type=int, default=20, help="requests per client")
    parser.add_argument("--responses", type=int, default=8, help="responses per request")
    parser.add_argument("--words", type=int, default=48, help="words per response")
    parser.add_argument("--batch-size", type=int, default=16, help="the server's texts per forward")
    parser.add_argument("--max-batch", type=int, default=256,
                        help="the server's most texts per round")
    parser.add_argument("--max-wait-ms", type=float, default=5.0,
                        help="how long the server's rounds wait for more requests")
    parser.add_argument("--threads", type=int, default=1,
                        help="the server's torch threads (the clients use the other cores)")
    add_out_arg(parser)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder, ServerProcess(
            _classifier(args.model, folder), os.path.join(folder, "server.out"), threads=args.threads,
            batch_size=args.batch_size, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
            env={**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")},
    ) as server:
        measure(server.url, 1, 1, args.responses, args.words)  # warm-up
        rows = [measure(server.url, n, args.requests, args.responses, args.words)
                for n in args.clients]
    print(table([[r["clients"], r["requests"], r["errors"], f"{r['p50_ms']:.1f}",
                  f"{r['p99_ms']:.1f}", f"{r['requests_per_s']:.1f}", f"{r['responses_per_s']:.1f}",
                  f"{r['texts_per_round']:.1f}"] for r in rows],
                ["clients", "requests", "errors", "p50 ms", "p99 ms", "req/s", "responses/s",
                 "texts/round"]))
    result = {"args": vars(args), "machine": machine(), "results": rows}
    return finish(args, result, "reward_server")


if __name__ == "__main__":
    main()
