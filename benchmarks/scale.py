"""The largest run this machine holds: GRPO with a KL reference on real-sized models, per-process memory.

    .venv/bin/python benchmarks/scale.py --model qwen2.5-0.5b                 # full fine-tuning, AdamW
    .venv/bin/python benchmarks/scale.py --model qwen2.5-1.5b --lora 16       # LoRA r=16 on q,k,v,o
    .venv/bin/python benchmarks/scale.py --model tiny-qwen2 --steps 2         # the harness itself, seconds
    .venv/bin/python benchmarks/scale.py --model benchmarks/models/qwen2-107m/config.json \
        --model-dir runs/scale/qwen2-107m                                     # 107M, Qwen2 vocabulary (docs/benchmarks.md)

What it does:
1. writes a random-init model of the preset's architecture (`rlgraph plan` presets) as a Hugging
   Face directory, weights in bf16 safetensors as published checkpoints are, with the shipped
   character tokenizer (its ids fit every vocabulary), unless `--model-dir` already holds one;
2. runs `rlgraph train` on it (spmd, `--nproc` gloo ranks by default: the path a multi-GPU user
   takes), a few GRPO steps with KL to the reference, no warm start, tiny batches;
3. samples the resident memory (RSS) of the controller and of every worker process every
   `--interval` seconds and reports each one's peak, beside one fp32 copy of the policy, and the
   step and weight-sync times from the run's metrics;
4. sets each process's peak beside the memory model's figure for it (`rlgraph.plan.memory.process_memory`
   of the run's compiled plan) plus a baseline measured once: the RSS of a fresh interpreter that
   imported what a run's processes import (torch, transformers' Qwen2, rlgraph) and built nothing.

Peak RSS and PSS (`RssSampler`) count what a process really holds (allocator caching included),
sampled: a peak shorter than the interval can be missed, so the figures are lower bounds.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GiB = 2**30


def write_model(preset: str, out: Path, seed: int = 0) -> int:
    """A random-init model of `preset` in `out` (config.json, bf16 safetensors, tokenizer); its parameter count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlgraph.backends.local.models import load_tokenizer
    from rlgraph.plan.presets import load_model_config

    fields = dict(load_model_config(preset))
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    load_tokenizer(None).save_pretrained(str(out))
    return params


class RssSampler(threading.Thread):
    """Peak RSS and PSS of a process and all its descendants, per pid, sampled every `interval` seconds.

    RSS counts shared pages (tensors passed through shared memory, the interpreter's libraries) in
    every process that maps them; PSS divides each shared page among its sharers, so the PSS of all
    processes adds up to what the run takes from the machine."""

    def __init__(self, pid: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.root, self.interval = psutil.Process(pid), interval
        self.peaks: dict[int, int] = {}
        self.pss_peaks: dict[int, int] = {}
        self.total_pss_peak = 0
        self.names: dict[int, str] = {}
        self.parents: dict[int, int] = {}
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                processes = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            total = 0
            for process in processes:
                try:
                    memory = process.memory_full_info()
                    if process.pid not in self.names:
                        self.names[process.pid] = " ".join(process.cmdline()[1:])[:200]  # without the interpreter
                        self.parents[process.pid] = process.ppid()
                except psutil.Error:
                    continue
                self.peaks[process.pid] = max(memory.rss, self.peaks.get(process.pid, 0))
                self.pss_peaks[process.pid] = max(memory.pss, self.pss_peaks.get(process.pid, 0))
                total += memory.pss
            self.total_pss_peak = max(self.total_pss_peak, total)
            self.stopped.wait(self.interval)


def baseline_rss() -> int:
    """RSS (bytes) of a fresh interpreter after importing what the controller and a rank import, before
    anything is built: the part of every process the memory model does not count."""
    code = ("import psutil, transformers.models.qwen2.modeling_qwen2, rlgraph.train.run, rlgraph.runtime.spmd, "
            "rlgraph.backends.fsdp.executor; print(psutil.Process().memory_info().rss)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1])


def modelled(config_path: Path) -> dict[str, int]:
    """The memory model's bytes per process of the run `config_path` describes ("controller", "rank r"),
    from its compiled plan (nothing is built)."""
    from rlgraph.plan.memory import process_memory
    from rlgraph.train.config import load_config
    from rlgraph.train.setup import prepare

    compiled = prepare(load_config(config_path)).rl
    return {name: need.total for name, need in process_memory(compiled.plan, compiled.options).items()}


def against_model(peaks: dict[str, int], model: dict[str, int], baseline: int) -> dict[str, dict[str, float]]:
    """Per process: measured peak RSS, the model's figure plus the baseline, and (measured / that) - 1."""
    out = {}
    for label, rss in peaks.items():
        process = "controller" if label == "controller" else label.replace("worker", "rank")
        if process in model:
            estimate = baseline + model[process]
            out[process] = {"measured_gib": round(rss / GiB, 2), "estimate_gib": round(estimate / GiB, 2),
                            "model_gib": round(model[process] / GiB, 2), "error": round(rss / estimate - 1, 3)}
    return out


def run_config(args: argparse.Namespace, model_dir: Path, run_dir: Path) -> dict:
    lora = {"r": args.lora, "alpha": 2 * args.lora, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    return {
        "name": "scale", "run_dir": str(run_dir),
        "algorithm": {"name": "grpo", "hparams": {"kl": 0.01}},
        "model": {"path": str(model_dir), **({"lora": lora} if args.lora else {})},
        "data": {"train": str(ROOT / "examples/math_grpo/train.jsonl"), "prompt_field": "question",
                 "answer_field": "answer", "chat_template": False, "max_prompt_tokens": 16},
        "rewards": [{"name": "math"}],
        "rollout": {"prompts_per_step": args.prompts, "n": args.n, "max_new_tokens": args.tokens},
        "optimizer": {"name": "adamw", "lr": 1e-6},
        "train": {"steps": args.steps, "seed": 0},
        "runtime": {"runtime": args.runtime, "nproc": args.nproc, "device": "cpu", "threads": args.threads,
                    "timeout_s": args.timeout},
        "eval": {"every": 0},
        "checkpoint": {"every": 1000},  # none within the run: the figures are the steps
        "logging": {"progress": False, "plots": False, "tensorboard": False},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-0.5b", help="a preset name (rlgraph plan --model)")
    parser.add_argument("--model-dir", type=Path, help="where the model is written (default: runs/scale/<model>)")
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    parser.add_argument("--runtime", default="spmd", choices=("local", "spmd", "ray"))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--interval", type=float, default=0.25)
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds a worker step may take (a 0.5B step on 2 busy cores takes minutes)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "scale", help="where models, configs and runs go")
    args = parser.parse_args(argv)

    import yaml

    base = args.out
    base.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_dir or base / Path(args.model).name.removesuffix(".json")
    start = time.perf_counter()
    if not (model_dir / "config.json").is_file():
        params = write_model(args.model, model_dir)
        print(f"wrote {args.model} ({params / 1e6:.0f}M parameters) to {model_dir} in {time.perf_counter() - start:.0f} s")
    config = json.loads((model_dir / "config.json").read_text())
    params = _count_params(model_dir)
    label = Path(args.model).parent.name if args.model.endswith(".json") else args.model
    run_dir = base / f"run-{label}{'-lora' if args.lora else ''}"
    shutil.rmtree(run_dir, ignore_errors=True)
    config_path = base / f"{run_dir.name}.yaml"
    config_path.write_text(yaml.safe_dump(run_config(args, model_dir, run_dir), sort_keys=False))

    baseline = baseline_rss()
    command = [sys.executable, "-m", "rlgraph", "train", str(config_path)]
    began = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = RssSampler(process.pid, args.interval)
    sampler.start()
    output = process.communicate()[0]
    sampler.stopped.set()
    sampler.join()
    wall = time.perf_counter() - began
    peaks = {label: round(rss / GiB, 2) for label, rss in _labelled(sampler, process.pid, sampler.peaks).items()}
    pss = {label: round(value / GiB, 2) for label, value in _labelled(sampler, process.pid, sampler.pss_peaks).items()}
    if process.returncode != 0:
        print(output[-3000:])
        print(f"rlgraph train failed (exit {process.returncode}) after {wall:.0f} s; peak RSS (GiB): {peaks}, PSS: {pss}")
        return 1

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "reward" in row]
    fp32_policy = params * 4
    report = {
        "model": args.model, "params": params, "lora": args.lora, "runtime": args.runtime, "nproc": args.nproc,
        "hidden": config.get("hidden_size"), "layers": config.get("num_hidden_layers"),
        "wall_s": round(wall, 1), "fp32_policy_gib": round(fp32_policy / GiB, 2),
        "peak_rss_gib": peaks, "peak_pss_gib": pss, "peak_total_pss_gib": round(sampler.total_pss_peak / GiB, 2),
        "controller_peak_rss_gib": round(sampler.peaks.get(process.pid, 0) / GiB, 2),
        "step_s": _median(steps, "time/step_s"), "sync_s": _median(steps, "time/sync_weights_s"),
        "stage_s": {key: _median(steps, key) for key in sorted({k for row in steps for k in row if k.startswith("time/")})},
        "baseline_rss_gib": round(baseline / GiB, 2),
        "vs_memory_model": against_model(_labelled(sampler, process.pid, sampler.peaks), modelled(config_path), baseline),
    }
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def _labelled(sampler: RssSampler, controller: int, peaks: dict[int, int]) -> dict[str, int]:
    """Peaks by role: the controller, its worker processes (rank order = start order), other helpers."""
    out, ranks = {}, 0
    for pid, rss in sorted(peaks.items()):
        name = sampler.names.get(pid, "?")
        if pid == controller:
            label = "controller"
        elif "spawn_main" in name or "ray::" in name or "forkserver" in sampler.names.get(sampler.parents.get(pid), ""):
            # spawned, a Ray actor, or forked by the fork server (whose own cmdline the child keeps)
            label, ranks = f"worker {ranks}", ranks + 1
        else:
            label = f"other: {' '.join(name.split())[:60] or '?'}"  # e.g. a reward worker, the resource tracker
        out[label if label not in out else f"{label} #{pid}"] = rss
    return out


def _count_params(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():
                total += math.prod(handle.get_slice(name).get_shape())
    return total


def _median(rows: list[dict], key: str) -> float | None:
    values = [row[key] for row in rows if key in row]
    return round(statistics.median(values), 3) if values else None


if __name__ == "__main__":
    raise SystemExit(main())
