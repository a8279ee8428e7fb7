"""Measured check of the memory model (`rlgraph.plan.memory`) on the CPU demo's phases.

    .venv/bin/python benchmarks/memory_check.py             # the demo run and its phases
    .venv/bin/python benchmarks/memory_check.py --variants  # also bf16, checkpointing, eager attention

Runs the demo's own code (the tiny Qwen2 of `rlgraph/assets/tiny_qwen2.json`, fp32, AdamW, the
`sft` program through the interpreter, then the compiled `grpo` plan through the plan runner) and
counts the bytes of every live tensor storage with a `TorchDispatchMode`: every tensor an aten op
returns is recorded once per storage and released by a finalizer when the storage dies (torch
keeps one Python object per storage, so the finalizer fires exactly then). Tensors that exist
before a phase (weights, optimizer state, inputs) are registered first. This counts what torch
tensors really hold, views counted once, on any device; it does not see scratch memory a kernel
allocates and frees inside one op, nor the allocator's caching or fragmentation. Each phase's
peak is compared with what the memory model predicts for the same configuration; the check
fails (exit 1) if any estimate is more than 25% from its measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path

import attrs
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rlgraph.algorithms import evaluate, grpo, sft
import rlgraph as rg
from rlgraph.backends.local.generation import NativeGenerator
from rlgraph.backends.local.counter_sampling import SamplingParams
from rlgraph.backends.local.logprobs import sequence_logprobs
from rlgraph.backends.local.models import build_causal_lm, load_tokenizer
from rlgraph.data import arithmetic
from rlgraph.plan import memory as M
from rlgraph.plan.model_size import ModelShape
from rlgraph.plan.presets import get_preset
from rlgraph.runtime.runner import EagerRunner
from rlgraph.runtime.plan_runner import PlanRunner
from rlgraph.train.demo import DemoConfig, demo_setup
from rlgraph.train.loop import Trainer
from rlgraph.train.recipe import build_roles

TOLERANCE = 0.25


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of live tensor storages; `peaks[label]` is the most held inside any `phase(label)` block."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}  # id(storage) -> bytes
        self.current = 0
        self.peaks: dict[str, int] = {"all": 0}
        self.labels = ["all"]

    def track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self.live or storage.nbytes() == 0:
            return
        self.live[key] = storage.nbytes()
        self.current += storage.nbytes()
        weakref.finalize(storage, self._release, key)
        for label in self.labels:
            self.peaks[label] = max(self.peaks[label], self.current)

    def track_all(self, *objects: object) -> None:
        for leaf in tree_flatten(list(objects))[0]:
            if isinstance(leaf, torch.Tensor):
                self.track(leaf)

    def _release(self, key: int) -> None:
        self.current -= self.live.pop(key)

    @contextlib.contextmanager
    def phase(self, label: str) -> Iterator[None]:
        """Nested labels join with '/': `phase("grpo")` then `phase("update")` records `grpo/update`."""
        label = f"{self.labels[-1]}/{label}" if len(self.labels) > 1 else label
        self.labels.append(label)
        self.peaks[label] = max(self.peaks.get(label, 0), self.current)
        try:
            yield
        finally:
            self.labels.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                self.track(leaf)
        return out


@attrs.frozen
class Row:
    name: str
    estimate: M.MemoryBreakdown
    measured: int

    @property
    def error(self) -> float:
        return self.estimate.total / self.measured - 1.0


def _tiny_shape() -> ModelShape:
    return ModelShape.from_hf_config(get_preset("tiny-qwen2"))


def _largest(calls: list[tuple[int, int, int]]) -> tuple[int, int, int]:
    """The (rows, prompt width, response width) call with the most tokens."""
    return max(calls, key=lambda call: call[0] * (call[1] + call[2]))


def _train_estimate(calls: list[tuple[int, int, int]], **overrides: object) -> M.MemoryBreakdown:
    rows, prompt, response = _largest(calls)
    cfg = M.TrainMemoryConfig.for_device("cpu", **{"checkpointing": False, "micro_batch_tokens": rows * (prompt + response),
                                                   "seq_len": prompt + response, **overrides})
    return M.train_memory(_tiny_shape(), cfg)


def _shapes(calls: list[tuple[int, int, int]]) -> str:
    rows, prompt, response = _largest(calls)
    return f"{rows} rows x {prompt}+{response} tokens"


def demo_run(sft_steps: int, rl_steps: int) -> list[Row]:
    """The demo's own code for a few SFT and GRPO steps; one row per phase and one for the run."""
    torch.manual_seed(0)
    config = DemoConfig(device="cpu")  # the CPU demo: fp32, what the CPU estimates describe
    calls: dict[str, list[tuple[int, int, int]]] = {"sft/update": [], "grpo/update": [], "generate": []}
    tracker = LiveTensorBytes()
    with tempfile.TemporaryDirectory() as directory:  # its data files are read by the time it returns
        setup = demo_setup(config, directory)  # the demo's run, prepared as `rlgraph demo` prepares it
    with tracker:
        executor, tokenizer = build_roles(setup), setup.tokenizer
        model = executor.models["policy"].model
        tracker.track_all(list(model.parameters()), list(model.buffers()))
        update, generate = executor.update, executor.generate

        def measured_update(ref, batch, *args, **kwargs):
            calls[tracker.labels[-1] + "/update"].append((len(batch), batch.prompt_ids.shape[1], batch.response_ids.shape[1]))
            with tracker.phase("update"):
                return update(ref, batch, *args, **kwargs)

        def measured_generate(ref, prompts, *, n=1, max_new_tokens=None, **kwargs):
            calls["generate"].append((len(prompts) * n, prompts.ids.shape[1], max_new_tokens or config.max_new_tokens))
            with tracker.phase("generate"):
                return generate(ref, prompts, n=n, max_new_tokens=max_new_tokens, **kwargs)

        executor.update, executor.generate = measured_update, measured_generate
        splits = arithmetic.make_splits(seed=config.seed)
        sampler = arithmetic.PromptSampler(splits.train, batch_size=config.sft_batch, seed=config.seed)
        with tracker.phase("sft"):
            sft_trainer = Trainer(EagerRunner(sft.trace(), executor),
                                  lambda: arithmetic.to_demonstrations(sampler.next_batch(), tokenizer), sampler)
            for _ in sft_trainer.run(steps=sft_steps):
                pass
            EagerRunner(evaluate.trace(max_new_tokens=config.max_new_tokens), executor).run(
                arithmetic.to_prompts(splits.dev, tokenizer))
        for group in executor.models["policy"].optimizer.param_groups:
            group["lr"] = config.rl_lr
        with tracker.phase("grpo"):
            compiled = rg.compile(grpo, mesh="cpu:1", sizes={"B": config.rl_prompts, "P": 8, "T": config.max_new_tokens},
                                         n=config.rl_samples, temperature=config.temperature, max_new_tokens=config.max_new_tokens)
            rl_sampler = arithmetic.PromptSampler(splits.train, batch_size=config.rl_prompts, seed=config.seed + 1)
            rl_trainer = Trainer(PlanRunner(compiled, executor),
                                 lambda: arithmetic.to_prompts(rl_sampler.next_batch(), tokenizer), rl_sampler)
            for _ in rl_trainer.run(steps=rl_steps):
                pass
    shape = _tiny_shape()
    rows, prompt, new = _largest(calls["generate"])
    generation = M.generate_memory(shape, tp=1, batch_sequences=rows, max_seq_len=prompt + new, dtype=torch.float32, prompt_len=prompt)
    sft_train, rl_train = _train_estimate(calls["sft/update"]), _train_estimate(calls["grpo/update"])
    # The native engine samples with the trainer's own weights: one copy, so params=0 for generate.
    shared = attrs.evolve(generation, params=0)
    run = M.MemoryBreakdown.largest([M.colocated_peak({"train": train, "generate": shared}, offload=False)
                                     for train in (sft_train, rl_train)])
    return [
        Row(f"SFT update, {_shapes(calls['sft/update'])}", sft_train, tracker.peaks["sft/update"]),
        Row(f"GRPO update, {_shapes(calls['grpo/update'])}", rl_train, tracker.peaks["grpo/update"]),
        Row(f"demo run: {sft_steps} SFT + dev eval + {rl_steps} GRPO steps (colocated, no offload)", run, tracker.peaks["all"]),
    ]


def demonstrations(rows: int):
    """An SFT batch of the demo's task (`rows` problems) and the shipped tokenizer."""
    tokenizer = load_tokenizer()
    problems = arithmetic.PromptSampler(arithmetic.make_splits(seed=0).train, batch_size=rows, seed=0).next_batch()
    return arithmetic.to_demonstrations(problems, tokenizer), tokenizer


def isolated_phases(variants: bool) -> list[Row]:
    """Generation and a no-grad log-prob forward alone (weights only), and, with `variants`, one
    training step under other dtypes / checkpointing / attention kernels."""
    shape, rows = _tiny_shape(), []
    batch, tokenizer = demonstrations(256)
    tokens = len(batch) * (batch.prompt_ids.shape[1] + batch.response_ids.shape[1])
    tracker = LiveTensorBytes()
    with tracker:
        model = build_causal_lm(tokenizer=tokenizer, seed=0)
        tracker.track_all(list(model.parameters()), list(model.buffers()), attrs.astuple(batch, recurse=False)[:6])
        prompts = arithmetic.to_prompts(arithmetic.make_splits(seed=0).train[:32], tokenizer)
        engine = NativeGenerator(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        with tracker.phase("generate"):
            engine.generate(prompts, 8, SamplingParams(max_new_tokens=5), seed=0)
        with tracker.phase("infer"), torch.no_grad():
            model.eval()
            sequence_logprobs(model, batch)
    width = prompts.ids.shape[1]
    rows.append(Row(f"generate alone, 32x8 rows x {width}+5 tokens", M.generate_memory(
        shape, tp=1, batch_sequences=256, max_seq_len=width + 5, dtype=torch.float32, prompt_len=width), tracker.peaks["generate"]))
    rows.append(Row(f"log-probs without grad alone, {tokens} tokens", M.infer_memory(
        shape, batch_tokens=tokens, dtype=torch.float32), tracker.peaks["infer"]))
    if variants:
        batch, tokenizer = demonstrations(128)
        for label, dtype, ckpt, attention in (("bf16 weights", torch.bfloat16, False, "sdpa"),
                                              ("activation checkpointing", torch.float32, True, "sdpa"),
                                              ("eager attention", torch.float32, False, "eager")):
            rows.append(measure_train_step(batch, tokenizer, dtype=dtype, checkpointing=ckpt, attention=attention, label=label))
    return rows


def measure_train_step(batch, tokenizer, *, dtype: torch.dtype = torch.float32, checkpointing: bool = False,
                       attention: str = "sdpa", label: str = "fp32") -> Row:
    """Two AdamW steps of the tiny model on `batch` (log-prob loss), measured and estimated."""
    tracker = LiveTensorBytes()
    with tracker:
        model = build_causal_lm(tokenizer=tokenizer, seed=0).to(dtype)
        model.config._attn_implementation = attention
        if checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": False})
        tracker.track_all(list(model.parameters()), list(model.buffers()), attrs.astuple(batch, recurse=False)[:6])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with tracker.phase("train"):
            for _ in range(2):  # the second step has the AdamW moments resident
                optimizer.zero_grad(set_to_none=True)
                lp = sequence_logprobs(model, batch)  # [N, T]
                (-(lp * batch.mask).sum() / batch.mask.sum()).backward()
                optimizer.step()
                del lp
    call = [(len(batch), batch.prompt_ids.shape[1], batch.response_ids.shape[1])]
    estimate = _train_estimate(call, param_dtype=dtype, checkpointing=checkpointing, fused_attention=attention != "eager")
    return Row(f"variant: {label}, {_shapes(call)}", estimate, tracker.peaks["train"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sft-steps", type=int, default=3)
    parser.add_argument("--rl-steps", type=int, default=2)
    parser.add_argument("--variants", action="store_true", help="also bf16, activation checkpointing, eager attention")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    rows = demo_run(args.sft_steps, args.rl_steps) + isolated_phases(args.variants)
    print(f"{'phase':<72} {'estimate':>10} {'measured':>10} {'error':>7}")
    for row in rows:
        print(f"{row.name:<72} {row.estimate.total / M.MiB:>7.2f} MiB {row.measured / M.MiB:>6.2f} MiB {row.error:>+7.1%}")
        print(f"    estimate: {row.estimate}")
    if args.json:
        args.json.write_text(json.dumps([{"phase": row.name, "estimate": row.estimate.as_dict(), "measured": row.measured,
                                          "error": row.error} for row in rows], indent=1))
    failed = [row.name for row in rows if abs(row.error) > TOLERANCE]
    print(f"{'FAIL' if failed else 'ok'}: {len(rows) - len(failed)}/{len(rows)} estimates within {TOLERANCE:.0%} of the measured peak")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
