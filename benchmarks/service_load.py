"""A load test with a hostile tenant: N honest clients (the official tinker SDK) train and sample on
a local `rlgraph serve` (127.0.0.1 only) while one more key attacks it with huge declared sizes,
oversize chunked bodies, deep JSON, long prompts, reused ids and floods. Each round runs the honest
clients twice on fresh servers, without and with the hostile one (alternated), and compares the
honest clients' p50/p99 latency and their results: the same seeds must give the same losses and
step counters, whatever the hostile key does. Bounded in count (--cycles, --flood) and time
(--max-seconds per phase).

    .venv/bin/python benchmarks/service_load.py [--clients 3] [--cycles 20] [--rounds 2] [--flood 3000]
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import logging

import httpx
import numpy as np
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

import tinker

TEXTS = ["12+7=19", "3+4=7", "20+5=25", "9+9=18"]


class Server:
    """`rlgraph serve --model tiny` in a subprocess on 127.0.0.1 with `keys`; its peak RSS sampled."""

    def __init__(self, work: Path, keys: list[str]):
        (work / "keys").write_text("\n".join(keys) + "\n")
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rlgraph", "serve", "--model", "tiny", "--host", "127.0.0.1", "--port", str(self.port),
             "--keys", str(work / "keys"), "--state-dir", str(work / "states")],
            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(f"{self.url}/api/v1/healthz", timeout=2)
                break
            except httpx.TransportError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("rlgraph serve did not start") from None
                time.sleep(0.3)
        self.peak_mib, self._stop = self.rss_mib(), threading.Event()
        self._sampler = threading.Thread(target=self._sample_rss, daemon=True)
        self._sampler.start()

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def _sample_rss(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.peak_mib = max(self.peak_mib, self.rss_mib())
            except OSError:
                return

    def stop(self) -> None:
        self._stop.set()
        self.process.terminate()
        self.process.wait(timeout=30)


def datums(tokenizer) -> list:
    out = []
    for text in TEXTS:
        seq = tokenizer.encode(text)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs={"target_tokens": seq[1:]}))
    return out


def honest(url: str, key: str, seed: int, cycles: int, record: dict) -> None:
    """forward_backward + optim_step + a seeded sample per cycle; latencies, losses, steps, samples."""
    service = tinker.ServiceClient(base_url=url, api_key=key)
    training = service.create_lora_training_client(base_model="tiny", rank=8, seed=seed).result()
    tokenizer = training.get_tokenizer()
    data, prompt = datums(tokenizer), types.ModelInput.from_ints(tokenizer.encode("12+7="))
    sampler = training.save_weights_and_get_sampling_client().result()
    for _ in range(cycles):
        start = time.perf_counter()
        loss = training.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
        step = training.optim_step(types.AdamParams(learning_rate=1e-2)).result().metrics["step:max"]
        middle = time.perf_counter()
        tokens = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4, seed=1)).result().sequences[0].tokens
        record["train ms"].append((middle - start) * 1e3)
        record["sample ms"].append((time.perf_counter() - middle) * 1e3)
        record["losses"].append(loss)
        record["steps"].append(int(step))
        record["samples"].append(tokens)


def batch(model_id: str, rows: int = 32, length: int = 40) -> bytes:
    """A valid forward_backward of `rows` datums of `length` tokens, without a seq_id: the flood's call."""
    message = pb.ForwardBackwardRequest(model_id=model_id, loss_fn="cross_entropy")
    tokens = np.arange(length + 1, dtype=np.int64) % 40 + 3
    for _ in range(rows):
        datum = message.data.add()
        datum.model_input.add().encoded_text.tokens = tokens[:-1].astype(np.int32).tobytes()
        datum.loss_fn_inputs["target_tokens"].CopyFrom(pb.Tensor(dense=tokens[1:].tobytes(), dtype=pb.DTYPE_INT64,
                                                                 shape=[length]))
    return message.SerializeToString()


def sparse_claim(model_id: str) -> bytes:
    """A ~300-byte forward_backward whose loss input claims a 10^9 x 10^9 sparse tensor."""
    message = pb.ForwardBackwardRequest(model_id=model_id, seq_id=0, loss_fn="cross_entropy")
    for _ in range(4):
        datum = message.data.add()
        datum.model_input.add().encoded_text.tokens = np.arange(1, 5, dtype=np.int32).tobytes()
        csr = pb.SparseCsr(values=np.ones(1, np.float32).tobytes(), crow_indices=np.asarray([0, 1], np.int64).tobytes(),
                           col_indices=np.zeros(1, np.int64).tobytes())
        datum.loss_fn_inputs["weights"].CopyFrom(pb.Tensor(sparse_csr=csr, dtype=pb.DTYPE_FLOAT32, shape=[10**9, 10**9]))
    return message.SerializeToString()


def chunked_body(url: str, key: str, megabytes: int) -> tuple[str, int]:
    """POST `megabytes` MB as a chunked body; (the status line, the bytes sent before the server answered)."""
    host, port = url.removeprefix("http://").split(":")
    piece = b"x" * 65536
    sent = 0
    with socket.create_connection((host, int(port)), timeout=30) as raw:
        raw.sendall(f"POST /api/v1/optim_step HTTP/1.1\r\nHost: x\r\nX-API-Key: {key}\r\nTransfer-Encoding: chunked\r\n"
                    "Content-Type: application/json\r\n\r\n".encode())
        raw.settimeout(0.001)
        for _ in range(megabytes * 16):
            try:
                answer = raw.recv(64)
                return answer.split(b"\r\n")[0].decode(), sent
            except (TimeoutError, BlockingIOError):
                pass
            except OSError:
                return "reset", sent
            try:
                raw.settimeout(30)
                raw.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                raw.settimeout(0.001)
                sent += len(piece)
            except OSError:
                break
        raw.settimeout(30)
        try:
            return raw.recv(64).split(b"\r\n")[0].decode(), sent
        except OSError:
            return "reset", sent


def hostile(url: str, key: str, flood: int, stop: threading.Event, record: dict) -> None:
    """Attacks in turn until the honest clients are done; each answer's status counted per attack."""
    service = tinker.ServiceClient(base_url=url, api_key=key)
    training = service.create_lora_training_client(base_model="tiny", rank=8).result()
    model, session = training.model_id, training.holder.get_session_id()
    client = httpx.Client(timeout=60, headers={"X-API-Key": key})
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    times: dict[str, list[float]] = collections.defaultdict(list)
    deep = b"[" * 200_000 + b"]" * 200_000

    def hit(name: str, route: str, **kwargs) -> None:
        start = time.perf_counter()
        status = client.post(f"{url}{route}", **kwargs).status_code
        counts[name][status] += 1
        times[name].append((time.perf_counter() - start) * 1e3)

    flood_body = batch(model)

    def flood_burst(count: int) -> None:  # forward_backwards of 32 x 40 tokens, no seq_id, 4 connections at once
        def one(_):
            return client.post(f"{url}/api/v1/forward_backward", content=flood_body,
                               headers={"Content-Type": "application/x-protobuf"}).status_code
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            counts["flood: forward_backward (32 x 40 tokens), no seq_id"].update(pool.map(one, range(count)))

    attacks = [
        lambda: hit("sparse 10^18 values in 300 bytes", "/api/v1/forward_backward", content=sparse_claim(model),
                    headers={"Content-Type": "application/x-protobuf"}),
        lambda: counts["chunked 100 MB body"].update([chunked_body(url, key, 100)[0]]),
        lambda: hit("JSON nested 200,000 deep", "/api/v1/optim_step", content=deep,
                    headers={"Content-Type": "application/json"}),
        lambda: hit("15 MB OpenAI prompt", "/v1/completions", json={"model": "tiny", "prompt": "1" * 15_000_000}),
        lambda: hit("reused sampling_session_seq_id", "/api/v1/save_weights_for_sampler",
                    json={"model_id": model, "sampling_session_seq_id": 7}),
        lambda: hit("learning_rate 1e308", "/api/v1/optim_step",
                    json={"model_id": model, "adam_params": {"learning_rate": 1e308}}),
        lambda: hit("seq_id as a list", "/api/v1/optim_step", json={"model_id": model, "seq_id": [1], "adam_params": {}}),
        lambda: hit("sessions", "/api/v1/create_session", json={"tags": [], "sdk_version": "0", "session": session}),
        lambda: flood_burst(min(flood, 500)),
    ]
    done = 0
    while not stop.is_set() and done < flood:
        for attack in attacks:
            if stop.is_set():
                break
            attack()
        done += 500
    record["hostile"] = {name: dict(counter) for name, counter in counts.items()}
    record["hostile ms"] = dict(times)


def phase(work: Path, clients: int, cycles: int, with_hostile: bool, flood: int, limit_s: float) -> dict:
    keys = [f"tml-{'k' * 20}{i:04d}" for i in range(clients + 1)]
    server = Server(work, keys)
    records = [collections.defaultdict(list) for _ in range(clients)]
    hostile_record: dict = {}
    stop = threading.Event()
    threads = [threading.Thread(target=honest, args=(server.url, keys[i], i, cycles, records[i])) for i in range(clients)]
    attacker = threading.Thread(target=hostile, args=(server.url, keys[-1], flood, stop, hostile_record))
    try:
        if with_hostile:
            attacker.start()
            time.sleep(1.0)  # the attack is under way before the honest clients start
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=limit_s)
        elapsed = time.perf_counter() - start
        stop.set()
        if with_hostile:
            attacker.join(timeout=limit_s)
        healthy = httpx.get(f"{server.url}/api/v1/healthz", timeout=10).status_code == 200
    finally:
        stop.set()
        server.stop()
    return {"records": records, "hostile": hostile_record.get("hostile", {}),
            "hostile ms": hostile_record.get("hostile ms", {}), "seconds": elapsed,
            "peak MiB": server.peak_mib, "healthy": healthy, "finished": all(not t.is_alive() for t in threads)}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--flood", type=int, default=3000, help="at most this many flood calls a phase")
    parser.add_argument("--max-seconds", type=float, default=300.0, help="the honest clients' limit a phase")
    args = parser.parse_args()
    logging.getLogger("tinker").setLevel(logging.CRITICAL)  # heartbeats of a stopped phase's server are not news
    runs: dict[str, list[dict]] = {"alone": [], "hostile": []}
    for round_ in range(args.rounds):  # alternated: each side sees the same machine load on average
        for side in (("alone", "hostile") if round_ % 2 == 0 else ("hostile", "alone")):
            work = Path(tempfile.mkdtemp(prefix=f"service_load_{side}_"))
            runs[side].append(phase(work, args.clients, args.cycles, side == "hostile", args.flood, args.max_seconds))
            print(f"round {round_} {side}: {runs[side][-1]['seconds']:.1f} s, peak RSS {runs[side][-1]['peak MiB']:.0f} MiB",
                  flush=True)
    print(f"\n{args.clients} honest SDK clients x {args.cycles} cycles (forward_backward of 4 datums + optim_step; "
          f"a seeded sample of 2 x 4 tokens), {args.rounds} rounds, rlgraph serve --model tiny on 127.0.0.1\n")
    print("| | alone | with the hostile key | ratio |\n| --- | --- | --- | --- |")
    for name in ("train ms", "sample ms"):
        values = {side: [v for run in runs[side] for record in run["records"] for v in record[name]] for side in runs}
        for label, q in (("p50", 0.5), ("p99", 0.99)):
            alone, hostile_ = percentile(values["alone"], q), percentile(values["hostile"], q)
            print(f"| {name.split()[0]} {label} ms | {alone:.1f} | {hostile_:.1f} | {hostile_ / alone:.2f} |")
    for side in runs:
        print(f"| {side}: peak server RSS MiB | " + ", ".join(f"{run['peak MiB']:.0f}" for run in runs[side]) + " | | |")
    reference = runs["alone"][0]["records"]
    same = all(run["records"][i][field] == reference[i][field] for side in runs for run in runs[side]
               for i in range(args.clients) for field in ("losses", "steps", "samples"))
    exact = all(run["records"][i]["steps"] == list(range(1, args.cycles + 1)) for side in runs for run in runs[side]
                for i in range(args.clients))
    print(f"\nhonest results identical in every run (losses, step counters, seeded samples): {same}; every update "
          f"exactly once: {exact}; all finished: {all(run['finished'] for side in runs for run in runs[side])}; "
          f"server healthy after: {all(run['healthy'] for side in runs for run in runs[side])}")
    print("\n| hostile request | answers (status: count), all hostile rounds | median ms |\n| --- | --- | --- |")
    merged: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    times: dict[str, list[float]] = collections.defaultdict(list)
    for run in runs["hostile"]:
        for name, counter in run["hostile"].items():
            merged[name].update(counter)
        for name, values in run["hostile ms"].items():
            times[name] += values
    for name, counter in merged.items():
        median = f"{statistics.median(times[name]):.1f}" if times[name] else "-"
        print(f"| {name} | {json.dumps({str(k): v for k, v in sorted(counter.items(), key=str)})} | {median} |")


if __name__ == "__main__":
    main()
