"""The training step's forward + loss + backward, eager against `torch.compile`, alternated in one run.

    .venv/bin/python benchmarks/train_compile.py                    # tiny Qwen2, demo-sized batch
    .venv/bin/python benchmarks/train_compile.py --rows 256 --tokens 16
    TORCHINDUCTOR_CACHE_DIR=/tmp/ind .venv/bin/python benchmarks/train_compile.py --bench small --steps 60

`--bench CONFIG`: the compiled update and reference stages of `rlgraph bench`'s GRPO step as the
executor runs them now ("after") against the executor before issue 24's update work ("before":
the LM head eager outside the compiled forward, Inductor's Python wrapper, `clip_grad_norm_`, a
`train()`/`eval()` walk on every call), two `RlgraphSide`s (`generation.compile=on`, `train.compile=on`) on the same prompts,
alternated in rounds after their warm-up; prints each side's median step and its stage means.

What is timed is what the update stage runs per micro-batch: the policy's sequence log-probs
(`rlgraph.backends.local.logprobs.sequence_logprobs`: the decoder and the chunked log-prob head),
a PPO-clip loss over them (`rlgraph.functional` math, token mean), and the backward. The compiled
side wraps that whole function in `torch.compile`; its first call (the compile) is reported apart.
Medians over `--rounds` alternated rounds, and their ratio.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlgraph.backends.local.executor import LocalExecutor  # noqa: E402
from rlgraph.backends.local.logprobs import role_outputs  # noqa: E402
from rlgraph.backends.local.generation import NativeGenerator
from rlgraph.backends.local.counter_sampling import SamplingParams
from rlgraph.backends.local.train_compile import mark_dynamic_shapes  # noqa: E402
from rlgraph.bench import CONFIGS, RlgraphSide, bench_problems, write_model  # noqa: E402
from rlgraph.backends.local.logprobs import sequence_logprobs  # noqa: E402
from rlgraph.backends.local.models import build_causal_lm, load_tokenizer  # noqa: E402
from decode import prompts  # noqa: E402 - benchmarks/decode.py: the same arithmetic prompts


def rollouts(model, tokenizer, rows: int, tokens: int):
    generator = NativeGenerator(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return generator.generate(prompts(tokenizer, rows), 1, SamplingParams(temperature=1.0, max_new_tokens=tokens), seed=0)


def step(model, batch, advantages: torch.Tensor, clip: float = 0.2) -> torch.Tensor:
    lp = sequence_logprobs(model, batch, temperature=1.0, with_entropy=False)  # [N, T]
    ratio = torch.exp(lp - batch.logprobs)  # [N, T]
    surrogate = torch.minimum(ratio * advantages[:, None], ratio.clamp(1 - clip, 1 + clip) * advantages[:, None])
    mask = batch.mask.float()  # [N, T]
    loss = -(surrogate * mask).sum() / mask.sum()
    loss.backward()
    return loss.detach()


@functools.cache
def python_wrapped_role_outputs():
    """`role_outputs` compiled as before issue 24's update work: Inductor's Python wrapper."""
    return torch.compile(role_outputs)


class BeforeUpdateWork(LocalExecutor):
    """The executor's update and inference paths as they were before issue 24's update work."""

    def _compiled_forward(self, worker, rollouts, *, temperature, with_entropy, packed=False):
        if not self.compile_train:
            return super()._compiled_forward(worker, rollouts, temperature=temperature, with_entropy=with_entropy,
                                             packed=packed)
        return python_wrapped_role_outputs()(worker.model, worker.kind, mark_dynamic_shapes(rollouts), temperature=temperature,
                                       with_entropy=with_entropy, packed=packed, dense_head=False)

    def _clip_grads(self, worker, clip):
        return float(torch.nn.utils.clip_grad_norm_(worker.model.parameters(), clip))

    def _train_epochs(self, worker, *args, **kwargs):
        worker.model.train()  # the walk of every update (`set_mode` then finds nothing to do)
        return super()._train_epochs(worker, *args, **kwargs)

    def _inference(self, worker, *args, **kwargs):
        was_training = worker.model.training
        worker.model.eval()
        try:
            return super()._inference(worker, *args, **kwargs)
        finally:
            worker.model.train(was_training)


def timed(executor: LocalExecutor, primitive: str, seconds: list[tuple[float, float]]) -> None:
    """Record each call of `executor.<primitive>` as (wall, thread CPU) seconds. On the loaded
    2-core machine the thread's CPU time leaves out the time other processes held the core."""
    call = getattr(executor, primitive)

    def timed_call(*args, **kwargs):
        wall, cpu = time.perf_counter(), time.thread_time()
        result = call(*args, **kwargs)
        seconds.append((time.perf_counter() - wall, time.thread_time() - cpu))
        return result

    setattr(executor, primitive, timed_call)


def bench_stages(config_name: str, steps: int, per_round: int, warmup: int) -> None:
    """`--bench`: the module docstring."""
    config = CONFIGS[config_name]
    rounds = -(-steps // per_round)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(config, Path(tmp) / "model")
        problems = bench_problems(config, (rounds * per_round + warmup) * config.prompts)
        sides = {name: RlgraphSide(config, model_dir, problems, decode_compile="on", compile_train=True)
                 for name in ("before", "after")}
        sides["before"].executor.__class__ = BeforeUpdateWork
        calls = {name: {"update": [], "logprobs": []} for name in sides}
        for name, side in sides.items():
            for primitive, seconds in calls[name].items():
                timed(side.executor, primitive, seconds)
            start = time.perf_counter()
            for _ in range(warmup):
                side.step()
            print(f"{name}: warm-up {time.perf_counter() - start:.1f} s (the compiles)", flush=True)
            side.mark_warm()
            for seconds in calls[name].values():
                seconds.clear()
        for k in range(rounds):
            for name in (("before", "after") if k % 2 == 0 else ("after", "before")):
                for _ in range(per_round):
                    sides[name].step()
        for name, side in sides.items():
            stages = side.stages_per_step(rounds * per_round)
            shown = ", ".join(f"{kind} {seconds * 1e3:.2f}" for kind, seconds in stages.items() if seconds > 2e-4)
            print(f"{name}: median {statistics.median(side.seconds[warmup:]) * 1e3:.2f} ms a step; "
                  f"ms a step by stage: {shown}")
            for primitive, seconds in calls[name].items():  # (wall, thread CPU) a call
                wall, cpu = (statistics.median(pair[i] for pair in seconds) * 1e3 for i in (0, 1))
                print(f"  {primitive}: median {wall:.2f} ms wall, {cpu:.2f} ms thread CPU over {len(seconds)} calls")
        for side in sides.values():
            side.close()
    print(f"load average after: {os.getloadavg()[0]:.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--tokens", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bench", choices=sorted(CONFIGS), help="before/after of the update work (docstring)")
    parser.add_argument("--steps", type=int, default=60, help="--bench: measured steps per side")
    parser.add_argument("--per-round", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    if args.bench:
        torch.set_num_threads(1)  # as `rlgraph bench`
        bench_stages(args.bench, args.steps, args.per_round, args.warmup)
        return 0
    torch.set_num_threads(args.threads)
    tokenizer, model = load_tokenizer(None), build_causal_lm(None)
    compiled = torch.compile(step)
    print("| rows | tokens | eager ms | compiled ms | ratio | compile s | loss difference |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for rows in args.rows:
        batch = rollouts(model, tokenizer, rows, args.tokens)
        advantages = torch.randn(rows, generator=torch.Generator().manual_seed(rows))  # [N]
        model.train()
        start = time.perf_counter()
        compiled(model, batch, advantages)
        compile_s = time.perf_counter() - start
        times = {"eager": [], "compiled": []}
        losses = {}
        for _ in range(args.rounds):
            for name, fn in (("eager", step), ("compiled", compiled)):
                model.zero_grad(set_to_none=True)
                begin = time.perf_counter()
                losses[name] = float(fn(model, batch, advantages))
                times[name].append(time.perf_counter() - begin)
        e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
        print(f"| {rows} | {batch.response_ids.shape[1]} | {e * 1e3:.1f} | {c * 1e3:.1f} | {e / c:.2f}x | "
              f"{compile_s:.1f} | {abs(losses['eager'] - losses['compiled']):.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
