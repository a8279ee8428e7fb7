"""The demo run: a tiny Qwen2 learns two-number addition, SFT warm start then RL, on CPU (or CUDA).

The demo is a configuration, not a trainer of its own: `demo_config` turns the flags of
`rlgraph demo` into a `TrainConfig` (the shipped tiny model, the arithmetic splits written as
JSONL, exact-match reward, an SFT warm start to a target accuracy on the dev split, evaluation on
the held-out test problems) and `rlgraph.train.run.train()` runs it, on every runtime: on spmd and Ray the
controller builds no model (the warm start and the evaluations run as plans on the workers).
The RL algorithm is any of `rlgraph.algorithms` (GRPO by default; PPO gets a critic initialised
from the warm-started policy; DAPO refills its batch from the same prompt sampler). Defaults
follow the configuration measured with a hand-written loop in shared/ENV-NOTES.md, so the gap to
those figures is rlgraph's overhead.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import attrs
import torch
from rich.console import Console
from rich.table import Table

from rlgraph.algorithms import ALGORITHMS
from rlgraph.data import arithmetic
from rlgraph.train.config import TrainConfig

# Demo-specific hyper-parameters: answers are <= 4 tokens (3 digits + EOS) of max_new_tokens=5, so
# DAPO's overlong punishment starts at the 5th token (a response that never stopped).
DEMO_HPARAMS: dict[str, dict[str, Any]] = {"dapo": {"overlong_buffer": 1}}
# agent_grpo needs an environment (rg.rollout): `rlgraph train` with an env: section runs it, not the demo
RL_ALGORITHMS = tuple(name for name in ALGORITHMS if name not in ("sft", "pretrain", "evaluate", "agent_grpo"))
NAME = "demo"  # the TrainConfig's name: a run directory whose config.yaml has it is the demo's own


@attrs.frozen
class DemoConfig:
    algorithm: str = "grpo"
    hparams: dict[str, Any] = attrs.field(factory=dict)  # the RL algorithm's, over DEMO_HPARAMS
    seed: int = 0
    sft_batch: int = 128
    sft_lr: float = 2e-3
    sft_target: float = 0.30      # stop SFT once dev accuracy reaches this: RL needs some signal to start from
    sft_max_steps: int = 800
    sft_eval_every: int = 10
    rl_prompts: int = 32
    rl_samples: int = 8
    rl_lr: float = 1e-4
    critic_lr: float = 1e-4       # PPO only
    rl_seconds: float = 120.0
    rl_max_steps: int | None = None
    temperature: float = 1.0
    max_new_tokens: int = 5
    threads: int = 2
    run_dir: str | None = "runs/demo"  # None: a temporary directory, removed at the end
    runtime: str = attrs.field(default="local", validator=attrs.validators.in_(("local", "spmd", "ray")))
    nproc: int = 2                # spmd/ray: workers (mesh ranks); the policy trains with FSDP2 over them
    address: str | None = None    # ray: a running cluster ("auto" after `ray start --head`); None starts a local one
    # Where the models live and run, on every runtime: auto is cuda when a GPU is present, else cpu.
    device: str = attrs.field(default="auto", validator=attrs.validators.in_(("auto", "cpu", "cuda")))
    timeout_s: float | None = None  # spmd: how long a step may wait on a worker (None: 60 s on CPU, 600 s on CUDA)


@attrs.frozen
class DemoResult:
    algorithm: str
    sft_steps: int
    sft_seconds: float
    rl_steps: int
    rl_seconds: float             # the RL steps' own time (time/step_s summed)
    test_before_rl: float         # held-out (test) accuracy after the warm start (which stopped on the dev split)
    test_after_rl: float
    samples_per_second: float     # rollouts generated (DAPO's dropped groups included) per second of RL
    trained_per_second: float     # rollouts the updates trained on per second of RL
    final_reward: float


def write_data(directory: Path, seed: int) -> tuple[Path, Path, Path]:
    """The arithmetic splits as JSONL (`prompt`, `answer`): (train, dev, test) paths. The warm start
    stops on the dev split; the test split is what the demo reports before and after RL."""
    splits = arithmetic.make_splits(seed=seed)
    directory.mkdir(parents=True, exist_ok=True)
    paths = directory / "train.jsonl", directory / "dev.jsonl", directory / "test.jsonl"
    for path, problems in zip(paths, (splits.train, splits.dev, splits.test)):
        path.write_text("".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n" for p in problems))
    return paths


def demo_config(config: DemoConfig, run_dir: Path, data: tuple[Path, Path, Path]) -> TrainConfig:
    """The `TrainConfig` the demo runs: `config`'s choices in the sections of `rlgraph train`."""
    train, dev, test = data
    hparams = {**DEMO_HPARAMS.get(config.algorithm, {}), **config.hparams}
    return TrainConfig.model_validate({
        "name": NAME, "run_dir": str(run_dir),
        "algorithm": {"name": config.algorithm, "hparams": hparams},
        "model": {"path": None},  # the shipped tiny Qwen2 and its character tokenizer
        "data": {"train": str(train), "eval": str(test), "chat_template": False},
        "rewards": [{"name": "exact_match"}],
        "reward_workers": 0,  # exact match is a string compare: no worker processes to start
        "rollout": {"prompts_per_step": config.rl_prompts, "n": config.rl_samples,
                    "max_new_tokens": config.max_new_tokens, "temperature": config.temperature},
        "runtime": {"runtime": config.runtime, "nproc": config.nproc if config.runtime != "local" else 1,
                    "device": config.device, "placement": "colocated:offload=False,checkpointing=False",
                    "engine": "native", "address": config.address, "timeout_s": config.timeout_s,
                    "threads": config.threads},
        "optimizer": {"name": "adamw", "lr": config.rl_lr, "critic_lr": config.critic_lr},
        "warm_start": {"steps": config.sft_max_steps, "batch_size": config.sft_batch, "lr": config.sft_lr,
                       "target_accuracy": config.sft_target, "eval_every": config.sft_eval_every, "eval": str(dev)},
        "train": {"steps": config.rl_max_steps, "seconds": config.rl_seconds, "seed": config.seed},
        "logging": {"tensorboard": False, "plots": False},
        "checkpoint": {"every": 10**9},  # the last step only (the run's end always checkpoints)
    })


def demo_setup(config: DemoConfig, directory: str | Path) -> Any:
    """The demo's prepared run (`rlgraph.train.setup.prepare`: tokenizer, rows, rewards, the compiled RL
    and evaluation plans), its data written under `directory`; what benchmarks and tests build from."""
    from rlgraph.train.setup import prepare

    directory = Path(directory)
    _check(config)
    return prepare(demo_config(config, directory, write_data(directory / "data", config.seed)))


def run_demo(config: DemoConfig = DemoConfig(), console: Console | None = None) -> DemoResult:
    """`rlgraph demo`: the demo's `TrainConfig` run by `train()`, then its held-out table."""
    from rlgraph.train.run import train

    _check(config)
    console = console or Console()
    torch.set_num_threads(config.threads)
    scratch = None if config.run_dir else tempfile.mkdtemp(prefix="rlgraph-demo-")
    run_dir = Path(config.run_dir or scratch)
    try:
        _forget_previous_demo(run_dir)
        from rlgraph.train.manifest import claim

        claim(run_dir, "data")  # the demo's own prompt files: a fresh run may write beside them
        train_config = demo_config(config, run_dir, write_data(run_dir / "data", config.seed))
        splits = arithmetic.make_splits(seed=config.seed)
        console.print(f"[bold]rlgraph demo[/]: {_parameters():,}-parameter Qwen2 learns A+B (A, B in [0, 99]); "
                      f"held-out {len(splits.test)} problems, greedy exact match")
        run = train(train_config, console=console)
        result = _result(config, run, run_dir)
        _report(console, result, run_dir if config.run_dir else None)
        return result
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _check(config: DemoConfig) -> None:
    """Refuse, before the warm start, what the demo cannot run, naming the flag or field."""
    if config.algorithm not in RL_ALGORITHMS:
        raise ValueError(f"demo: unknown RL algorithm {config.algorithm!r}; choose one of {', '.join(RL_ALGORITHMS)}")
    fixed = sorted({"n", "temperature", "max_new_tokens"} & set(config.hparams))
    if fixed:
        raise ValueError(f"demo: set {', '.join(fixed)} through DemoConfig (rl_samples, temperature, max_new_tokens), "
                         "not hparams: the demo sizes its batches and figures from them")
    if config.runtime == "local":
        return
    if config.nproc < 1 or config.rl_prompts % config.nproc:
        raise ValueError(f"demo: --nproc {config.nproc} must divide the {config.rl_prompts} prompts of an RL step "
                         "(each rank generates and trains on an equal share); try --nproc 2 or 4")
    if config.timeout_s is not None and not config.timeout_s > 0:
        raise ValueError(f"demo: --timeout must be a positive number of seconds, got {config.timeout_s}")


def _forget_previous_demo(run_dir: Path) -> None:
    """`make demo` twice starts afresh: the checkpoints of an earlier demo run in `run_dir` are
    removed (those of any other run are left, and `train()` refuses the directory)."""
    import yaml

    saved = run_dir / "config.yaml"
    if not saved.is_file() or (yaml.safe_load(saved.read_text()) or {}).get("name") != NAME:
        return
    from rlgraph.train.manifest import owns, remove_owned

    doomed = [*run_dir.glob("step-*"), *run_dir.glob(".step-*"),
              *(run_dir / name for name in ("latest", "metrics.jsonl", "samples.jsonl", "base.safetensors"))]
    for old in doomed:
        if owns(run_dir, old.name) and (old.exists() or old.is_symlink()):
            remove_owned(run_dir, old)  # only what rlgraph recorded writing: never a step-best of the user's


def _parameters() -> int:
    """The tiny Qwen2's parameter count, from its config on the meta device (no weights built)."""
    from rlgraph.backends.local.models import build_causal_lm, load_tokenizer

    with torch.device("meta"):
        return sum(p.numel() for p in build_causal_lm(tokenizer=load_tokenizer()).parameters())


def _result(config: DemoConfig, run: Any, run_dir: Path) -> DemoResult:
    """The demo's figures, read from the run's metrics.jsonl: step 0 is the warm start, then one row
    per RL step (and the final evaluation's row at the last step)."""
    from rlgraph.train.logging import METRICS_FILE

    rows = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines() if line.strip()]
    first, steps = rows[0], [row for row in rows if row["step"] > 0 and "time/step_s" in row]
    seconds = sum(row["time/step_s"] for row in steps)
    batch = config.rl_prompts * config.rl_samples
    generated = sum(row.get("filter/rounds", 1.0) for row in steps) * batch
    reward = 0.0
    for index, row in enumerate(steps):  # smoothed as the progress bar shows it
        reward = 0.9 * reward + 0.1 * row["reward"] if index else row["reward"]
    return DemoResult(
        algorithm=config.algorithm, sft_steps=int(first.get("warm_start/steps", 0)),
        sft_seconds=first.get("time/warm_start_s", 0.0), rl_steps=run.steps, rl_seconds=seconds,
        test_before_rl=run.eval_before, test_after_rl=run.eval_after,
        samples_per_second=generated / max(seconds, 1e-9), trained_per_second=len(steps) * batch / max(seconds, 1e-9),
        final_reward=reward)


def _report(console: Console, result: DemoResult, run_dir: Path | None) -> None:
    label = result.algorithm.upper()
    table = Table(title="held-out accuracy (200 problems, greedy)")
    table.add_column("before RL (after SFT)")
    table.add_column(f"after {label}")
    table.add_row(f"{result.test_before_rl:.1%}", f"{result.test_after_rl:.1%}")
    console.print(table)
    trained = f" ({result.trained_per_second:,.0f} trained on)" if result.trained_per_second != result.samples_per_second else ""
    console.print(f"SFT: {result.sft_steps} steps in {result.sft_seconds:.1f} s; {label}: {result.rl_steps} steps in "
                  f"{result.rl_seconds:.0f} s, {result.samples_per_second:,.0f} samples/s{trained}")
    if run_dir is not None:
        from rlgraph.train.manifest import claim

        claim(run_dir, "demo.json")
        (run_dir / "demo.json").write_text(json.dumps(attrs.asdict(result), indent=1))
