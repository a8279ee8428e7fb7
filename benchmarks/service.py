"""The training service: HTTP (the tinker SDK against `rlgraph serve` in another process) against the
in-process client, per call type, on the `large` bench model (4 layers, hidden 256); then a bounded
load test: a few concurrent SDK clients on 127.0.0.1, each its own tenant, reporting calls/s,
p50/p99 latency and that every update was applied exactly once (each optim_step's step counter
must come back as 1, 2, ..., K for its tenant: a lost update leaves a gap, a duplicate a repeat).

    .venv/bin/python benchmarks/service.py [--rounds 10] [--clients 4] [--cycles 15]
    .venv/bin/python benchmarks/service.py --in-process-only     # the in-process column alone, e.g. to
                                                                  # compare two checkouts (PYTHONPATH=...)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch
from tinker import types

import tinker
from rlgraph.bench import CONFIGS, write_model
from rlgraph.service.client import LocalServiceClient

KEY = "tml-" + "bench" * 8
TEXTS = ["12+7=19", "3+4=7", "20+5=25", "9+9=18", "45+11=56", "7+70=77", "33+33=66", "1+98=99"]


def datums(tokenizer, count: int = 16):
    data = []
    for text in (TEXTS * count)[:count]:
        seq = tokenizer.encode(text)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs={"target_tokens": seq[1:]}))
    return data


def calls(training, sampler, tokenizer, data):
    """One call of each type; each a function that waits for its result."""
    prompt = types.ModelInput.from_ints(tokenizer.encode("12+7="))
    return {
        "forward_backward (16 datums)": lambda: training.forward_backward(data, "cross_entropy").result(),
        "optim_step": lambda: training.optim_step(types.AdamParams(learning_rate=1e-4)).result(),
        "sample (8 x 32 tokens)": lambda: sampler.sample(prompt, 8, types.SamplingParams(max_tokens=32, seed=1)).result(),
        "compute_logprobs (8 tokens)": lambda: sampler.compute_logprobs(prompt).result(),
    }


def per_call(service, rounds: int) -> dict[str, float]:
    training = service.create_lora_training_client(base_model=BASE, rank=16).result()
    tokenizer = training.get_tokenizer()
    sampler = training.save_weights_and_get_sampling_client().result()
    timings: dict[str, list[float]] = {}
    table = calls(training, sampler, tokenizer, datums(tokenizer))
    for round_ in range(rounds + 1):  # the first round warms up
        for name, call in table.items():
            start = time.perf_counter()
            call()
            if round_:
                timings.setdefault(name, []).append(time.perf_counter() - start)
    return {name: statistics.median(values) * 1e3 for name, values in timings.items()}


def load_test(url: str, clients: int, cycles: int) -> dict[str, float]:
    latencies: list[float] = []
    steps: dict[int, list[int]] = {}
    lock = threading.Lock()

    def client(index: int) -> None:
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        training = service.create_lora_training_client(base_model=BASE, rank=8, seed=index).result()
        data = datums(training.get_tokenizer(), 8)
        for _ in range(cycles):
            for call in (lambda: training.forward_backward(data, "cross_entropy").result(),
                         lambda: training.optim_step(types.AdamParams(learning_rate=1e-4)).result()):
                start = time.perf_counter()
                result = call()
                with lock:
                    latencies.append(time.perf_counter() - start)
                    if hasattr(result, "metrics") and "step:max" in (result.metrics or {}):
                        steps.setdefault(index, []).append(int(result.metrics["step:max"]))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    exact = all(steps.get(i) == list(range(1, cycles + 1)) for i in range(clients))
    ordered = sorted(latencies)
    return {"calls": len(latencies), "seconds": elapsed, "calls/s": len(latencies) / elapsed,
            "p50 ms": ordered[len(ordered) // 2] * 1e3, "p99 ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3,
            "every update exactly once": exact}


def main() -> None:
    global BASE
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--cycles", type=int, default=15)
    parser.add_argument("--in-process-only", action="store_true", help="no server: print the in-process medians")
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="bench_service_"))
    BASE = str(write_model(CONFIGS["large"], work / "large"))
    local = LocalServiceClient(BASE, state_dir=work / "local")
    in_process = per_call(local, args.rounds)
    local.scheduler.close()
    if args.in_process_only:
        import rlgraph

        print(f"in-process ms (medians of {args.rounds}), rlgraph from {Path(rlgraph.__file__).parent}")
        print("\n".join(f"  {name}: {ms:.1f}" for name, ms in in_process.items()))
        return
    (work / "keys").write_text(KEY + "\n")
    port = 18000 + os.getpid() % 1000
    server = subprocess.Popen([sys.executable, "-m", "rlgraph", "serve", "--model", BASE, "--port", str(port), "--keys",
                               str(work / "keys"), "--state-dir", str(work / "states")],
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                httpx.get(f"{url}/api/v1/healthz", timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.3)
        over_http = per_call(tinker.ServiceClient(base_url=url, api_key=KEY), args.rounds)
        load = load_test(url, args.clients, args.cycles)
    finally:
        server.terminate()
        server.wait(timeout=30)
    print("| call (large model) | in-process ms | HTTP ms | HTTP overhead ms |")
    print("| --- | --- | --- | --- |")
    for name in in_process:
        print(f"| {name} | {in_process[name]:.1f} | {over_http[name]:.1f} | {over_http[name] - in_process[name]:.1f} |")
    print(f"\nload test, {args.clients} clients x {args.cycles} (forward_backward + optim_step), 127.0.0.1: "
          f"{load['calls']} calls in {load['seconds']:.1f} s = {load['calls/s']:.1f} calls/s, "
          f"p50 {load['p50 ms']:.0f} ms, p99 {load['p99 ms']:.0f} ms, every update exactly once: "
          f"{load['every update exactly once']}")


BASE = ""

if __name__ == "__main__":
    main()
