"""Two tenants on one server at once: an SFT tenant and an RL tenant, each equal to running alone.

    python examples/service/two_tenants.py

Each tenant is its own LoRA adapter, optimizer and random stream on the one base model; the
scheduler interleaves their calls (round robin), and neither sees the other's weights. The script
runs both tenants together (two threads, one server), then each alone on a fresh server, and
checks that every loss and every sampled token is the same.
"""

from __future__ import annotations

import sys
import tempfile
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rl_loop import Adam, Datum_, Sampling, as_input  # noqa: E402  (the SDK's types, or the service's own)

from rlgraph.service.client import LocalServiceClient  # noqa: E402

TEXTS = ["12+7=19", "3+4=7", "20+5=25", "9+9=18"]


def sft_tenant(service, steps: int = 5) -> list[float]:
    training = service.create_lora_training_client(base_model="tiny", rank=8, seed=0).result()
    tokenizer = training.get_tokenizer()
    data = []
    for text in TEXTS:
        seq = tokenizer.encode(text)
        data.append(Datum_(model_input=as_input(seq[:-1]), loss_fn_inputs={"target_tokens": seq[1:]}))
    losses = []
    for _ in range(steps):
        forward = training.forward_backward(data, "cross_entropy")
        training.optim_step(Adam(learning_rate=5e-3)).result()
        losses.append(forward.result().metrics["loss:sum"])
    return losses


def rl_tenant(service, steps: int = 3) -> list[object]:
    training = service.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    tokenizer = training.get_tokenizer()
    prompt = tokenizer.encode("12+7=")
    trace: list[object] = []
    for step in range(steps):
        sampler = training.save_weights_and_get_sampling_client().result()
        result = sampler.sample(as_input(prompt), 4, Sampling(max_tokens=3, temperature=1.0, seed=step)).result()
        data = []
        for i, sequence in enumerate(result.sequences):
            seq, pad = prompt + list(sequence.tokens), [0.0] * (len(prompt) - 1)
            advantage = 1.0 if i == 0 else -0.25  # a fixed preference for the first sample: enough to move the adapter
            data.append(Datum_(model_input=as_input(seq[:-1]), loss_fn_inputs={
                "target_tokens": seq[1:], "logprobs": pad + list(sequence.logprobs),
                "advantages": pad + [advantage] * len(sequence.tokens)}))
        forward = training.forward_backward(data, "importance_sampling")
        training.optim_step(Adam(learning_rate=1e-2)).result()
        trace.append(([list(s.tokens) for s in result.sequences], forward.result().metrics["loss:sum"]))
    return trace


def together() -> tuple[list[float], list[object]]:
    service = LocalServiceClient("tiny", state_dir=tempfile.mkdtemp())
    results: dict[str, object] = {}
    threads = [threading.Thread(target=lambda: results.__setitem__("sft", sft_tenant(service))),
               threading.Thread(target=lambda: results.__setitem__("rl", rl_tenant(service)))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        service.scheduler.close()
    return results["sft"], results["rl"]


def alone(tenant) -> object:
    service = LocalServiceClient("tiny", state_dir=tempfile.mkdtemp())
    try:
        return tenant(service)
    finally:
        service.scheduler.close()


def main() -> dict[str, object]:
    torch.set_num_threads(1)
    sft_both, rl_both = together()
    sft_alone, rl_alone = alone(sft_tenant), alone(rl_tenant)
    print(f"SFT tenant losses: together {[round(x, 3) for x in sft_both]}, alone {[round(x, 3) for x in sft_alone]}")
    print(f"RL tenant losses:  together {[round(x[1], 3) for x in rl_both]}, alone {[round(x[1], 3) for x in rl_alone]}")
    same = sft_both == sft_alone and rl_both == rl_alone
    print("each tenant equals running it alone" if same else "MISMATCH: a tenant saw the other")
    return {"same": same, "sft": sft_both, "rl": rl_both}


if __name__ == "__main__":
    sys.exit(0 if main()["same"] else 1)
