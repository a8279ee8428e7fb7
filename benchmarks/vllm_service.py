"""The training service's sample call on vLLM against the native engine (issue 33), sides alternated.

    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/vllm_service.py --rounds 5

One base (the tiny head_dim-32 Qwen2, random init) served twice in this process: `Service(engine="vllm")`
and `Service(engine="native")`. Each has a base sampler and a tenant's snapshot after one optim step.
Per round, on each side in turn: `--samples` sampled sequences of `--tokens` tokens from the snapshot
(the engine already serves it: no sync), then a sample from the base and one from the snapshot again
(two syncs on vLLM: adapters dropped, then loaded through `add_lora`). Prints the median seconds and
the vLLM / native ratio of each round's pair, and the vLLM syncs' seconds. Run in .venv-vllm.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from rlgraph.backends.local.models import TINY_VLLM_CONFIG
from rlgraph.service.core import SampleParams, Service
from rlgraph.service.datums import Datum
from rlgraph.service.tenants import LoraSpec

OWNER = "bench"


def _prepare(service: Service) -> list[int]:
    service.create_sampler(OWNER, "base", base_model=service.base.name)
    service.create_model(OWNER, "m", service.base.name, LoraSpec(rank=8, train_unembed=False))
    ids = service.base.tokenizer.encode("12+34=46")
    service.forward(OWNER, "m", [Datum(ids[:-1], {"target_tokens": ids[1:]})], "cross_entropy", backward=True)
    service.optim_step(OWNER, "m", {"learning_rate": 0.05})
    service.save_for_sampler(OWNER, "m", "snap")
    return service.base.tokenizer.encode("12+34=")


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    params = SampleParams(max_tokens=args.tokens, temperature=1.0, seed=0)
    with tempfile.TemporaryDirectory() as states:
        start = time.perf_counter()
        on_vllm = Service(str(TINY_VLLM_CONFIG), state_dir=f"{states}/v", engine="vllm")
        start_up = time.perf_counter() - start
        native = Service(str(TINY_VLLM_CONFIG), state_dir=f"{states}/n")
        prompt = {name: _prepare(service) for name, service in (("vllm", on_vllm), ("native", native))}
        times: dict[str, list[float]] = {"vllm": [], "native": [], "vllm_switch": [], "native_switch": []}
        for _ in range(args.rounds):
            for name, service in (("vllm", on_vllm), ("native", native)):
                sample = lambda sampler, n: service.sample(OWNER, sampler, prompt[name], n, params)  # noqa: E731
                sample("snap", args.samples)  # the engine serves the snapshot before the timed call
                times[name].append(_timed(lambda: sample("snap", args.samples)))
                times[f"{name}_switch"].append(_timed(lambda: (sample("base", 1), sample("snap", 1))))
        syncs = [seconds for executor in on_vllm.ranks.host.executors.values() for _, _, seconds in
                 getattr(executor, "syncs", [])]
        ratios = [v / n for v, n in zip(times["vllm"], times["native"])]
        print(json.dumps({"start_up_s": round(start_up, 2), "rounds": args.rounds, "samples": args.samples,
                          "tokens": args.tokens,
                          **{f"{key}_median_s": round(statistics.median(value), 4) for key, value in times.items()},
                          "vllm_over_native_median": round(statistics.median(ratios), 3),
                          "vllm_over_native_per_round": [round(r, 3) for r in ratios],
                          "vllm_sync_s_median": round(statistics.median(syncs), 4), "vllm_syncs": len(syncs)}, indent=1))
        on_vllm.close()
        native.close()


if __name__ == "__main__":
    main()
