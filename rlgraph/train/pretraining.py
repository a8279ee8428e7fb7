"""`rlgraph train` with `algorithm: pretrain`: continued pre-training on raw text, resumable mid-epoch.

    data: {train: corpus/}                               # .txt, a directory of .txt, .jsonl, ... (rlgraph.data.pretrain)
    pretrain: {seq_len: 128, packs_per_step: 8}
    algorithm: {name: pretrain}

Each step is one run of the compiled `pretrain` plan (the SFT update on packed segments) by the
plan runner, through the same `Trainer` as RL: its checkpoints hold the policy, its optimizer, the
torch RNG and the packer's cursor, so `--resume` continues exactly mid-epoch. The run directory
gets config.yaml, plan.txt, metrics.jsonl (loss, perplexity, tokens/s), step-* checkpoints and
summary.json; `rlgraph export` turns a checkpoint into a model directory that the next stage (SFT,
RL) names as `model.path`. The local runtime only, for now (refused otherwise, before anything starts).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from rlgraph.errors import ConfigError
from rlgraph.train.config import TrainConfig


def check_pretrain_config(config: TrainConfig) -> None:
    """What a pre-training run cannot take, refused with the key to change."""
    problems = [
        (config.runtime.runtime != "local", f"runtime.runtime={config.runtime.runtime}",
         "runtime.runtime: local (pre-training on spmd/ray workers is not built yet)"),
        (config.warm_start.steps > 0, f"warm_start.steps={config.warm_start.steps}",
         "warm_start.steps: 0 (the warm start is SFT on answers; pre-training has none)"),
        (config.env is not None, "an env: section", "remove env: (pre-training steps no environment)"),
        (config.rollout.staleness > 0, f"rollout.staleness={config.rollout.staleness}",
         "rollout.staleness: 0 (nothing is generated)"),
    ]
    for bad, what, fix in problems:
        if bad:
            raise ConfigError(f"algorithm pretrain cannot run with {what}", fix=f"set {fix}")


def compile_pretrain(config: TrainConfig, device: str) -> Any:
    """The `pretrain` plan on this process's device (one rank), packed micro-batches as configured."""
    from rlgraph.algorithms import pretrain
    from rlgraph.api import compile as compile_algorithm
    from rlgraph.plan.hardware import detect_device_kind
    from rlgraph.plan.mesh import Mesh, colocated

    pack = config.pretrain
    extra = {} if config.train.micro_batch_tokens is None else {"micro_batch_tokens": config.train.micro_batch_tokens}
    return compile_algorithm(pretrain, mesh=Mesh(detect_device_kind(device), 1, 1), placement=colocated(offload=False),
                             sizes={"B": pack.packs_per_step, "P": 1, "T": pack.seq_len, "n": 1},
                             models={"policy": config.model.path} if config.model.path else {},
                             **extra, **config.algorithm.hparams)


def train_pretrain(config: TrainConfig, *, resume: bool = False, checkpoint: str | int | None = None,
                   console: Console | None = None, overwrite: bool = False) -> Any:
    """Run `config` (algorithm pretrain) in `config.directory`; `resume` continues its latest checkpoint."""
    from rlgraph.train.loop import RunResult

    console = console or Console()
    trainer, logger, first = _open_run(config, resume, checkpoint, console, overwrite)
    start, train = time.perf_counter(), config.train
    remaining = None if train.steps is None else max(train.steps - trainer.step, 0)
    last: dict[str, float] = {}
    try:
        for metrics in trainer.run(steps=remaining, seconds=train.seconds) if remaining != 0 else ():
            last = metrics
            if config.logging.progress and (trainer.step == 1 or trainer.step % 10 == 0):
                console.print(f"PT step {trainer.step}: loss {metrics['nll']:.3f}, perplexity {metrics['perplexity']:.2f}, "
                              f"{metrics['tokens_per_s']:,.0f} tokens/s", markup=False, highlight=False)
        if trainer.step % config.checkpoint.every:
            trainer.save()  # the last step is always checkpointed
    finally:
        logger.close()
    seconds = time.perf_counter() - start
    first = first or (trainer.history[0] if trainer.history else {})
    summary = {"steps": trainer.step, "seconds": seconds, "tokens_per_step": config.pretrain.seq_len * config.pretrain.packs_per_step,
               "first_loss": first.get("nll"), "first_perplexity": first.get("perplexity"),
               "last_loss": last.get("nll"), "last_perplexity": last.get("perplexity")}
    (config.directory / "summary.json").write_text(json.dumps(summary, indent=1))
    if last:
        console.print(f"run {config.directory}: {trainer.step} steps in {seconds:.0f} s; loss {summary['first_loss']:.3f} "
                      f"-> {summary['last_loss']:.3f}, perplexity {summary['first_perplexity']:.2f} -> "
                      f"{summary['last_perplexity']:.2f}", markup=False, highlight=False)
    return RunResult(config.directory, trainer.step, seconds, None, None)


def _open_run(config: TrainConfig, resume: bool, checkpoint: Any, console: Console,
              overwrite: bool = False) -> tuple[Any, Any, dict]:
    """(the Trainer over the compiled plan and the packer, resumed if asked; the metric logger; the
    first logged step's metrics on a resume, else {})."""
    import torch

    from rlgraph.backends.local.models import load_tokenizer
    from rlgraph.backends.world import WorldSpec
    from rlgraph.data.pretrain import Packer, TextStream
    from rlgraph.runtime.plan_runner import PlanRunner
    from rlgraph.runtime.worker_pool import resolve_device
    from rlgraph.train.checkpoint import claim_file
    from rlgraph.train.logging import METRICS_FILE, MetricLogger, make_sinks
    from rlgraph.train.manifest import claim
    from rlgraph.train.loop import Trainer
    from rlgraph.train.roles import lr_factor, policy_spec
    from rlgraph.train.checkpoint import refuse_foreign, resume_point
    from rlgraph.train.setup import tokenizer_source
    from rlgraph.train.user_code import import_modules

    check_pretrain_config(config)
    import_modules(config.imports, "imports")
    if config.runtime.threads:
        torch.set_num_threads(config.runtime.threads)
    run_dir = config.directory
    if checkpoint is not None and not resume:
        raise ConfigError(f"--checkpoint {checkpoint}: a checkpoint to start from is only taken with --resume",
                          fix=f"rlgraph train --resume {run_dir} --checkpoint {checkpoint}")
    if not resume:  # the run directory rule of every run: nothing rlgraph did not write is overwritten
        refuse_foreign(run_dir, overwrite or config.overwrite)
    saved = resume_point(run_dir, checkpoint) if resume else None
    if saved is not None:
        _refuse_other_corpus(config, saved)
    torch.manual_seed(config.train.seed)
    device = str(resolve_device(config.runtime.device))
    tokenizer = load_tokenizer(tokenizer_source(config))
    packer = Packer(TextStream.open(config.data.train, text_field=config.pretrain.text_field), tokenizer,
                    seq_len=config.pretrain.seq_len, packs_per_step=config.pretrain.packs_per_step)
    compiled = compile_pretrain(config, device)
    run_dir.mkdir(parents=True, exist_ok=True)
    claim(run_dir, "plan.txt", METRICS_FILE, "summary.json", *(["tensorboard"] if config.logging.tensorboard else []),
          *(["wandb"] if config.logging.wandb is not None else []))  # before writing: a crash leaves nothing unrecorded
    (run_dir / "config.yaml").write_text(config.to_yaml())
    claim_file(run_dir, "config.yaml")  # read back by resume, eval and export: recorded with its sha256
    (run_dir / "plan.txt").write_text(compiled.as_text() + "\n")
    # the policy from the one role recipe (`policy_spec`), as every run builds it
    world = WorldSpec({"policy": policy_spec(config)}, tokenizer=tokenizer_source(config), max_new_tokens=1,
                      seed=config.train.seed)
    executor = world.build_local(device)
    tokens_per_step = config.pretrain.seq_len * config.pretrain.packs_per_step

    def before_step(step: int) -> None:
        executor.set_learning_rate("policy", config.optimizer.lr * lr_factor(config, step))

    def after_step(step: int, metrics: dict[str, float]) -> dict[str, float]:
        metrics = {**metrics, "lr": config.optimizer.lr * lr_factor(config, step - 1), "epoch": float(packer.epoch),
                   "tokens_per_s": tokens_per_step / metrics["time/step_s"]}
        logger.log(step, metrics)  # before the step's checkpoint: a run killed after it has its metrics
        return metrics

    trainer = Trainer(PlanRunner(compiled, executor), packer.next_batch, packer, run_dir=run_dir,
                      checkpoint_every=config.checkpoint.every, keep_last=config.checkpoint.keep_last,
                      before_step=before_step, after_step=after_step,
                      extra_state=lambda: {"fingerprint": _fingerprint(config)})
    if saved is not None:
        trainer.resume(saved)
        console.print(f"resumed {run_dir} at step {trainer.step} ({saved.name}): epoch {packer.epoch}, document "
                      f"{packer.document}, token {packer.offset}", markup=False, highlight=False)
    logger = MetricLogger(make_sinks(run_dir, tensorboard=config.logging.tensorboard, wandb=config.logging.wandb,
                                     mlflow=config.logging.mlflow, resume_step=trainer.step if saved else None))
    return trainer, logger, (trainer.history[0] if trainer.history else {})


def _fingerprint(config: TrainConfig) -> dict[str, str]:
    """The RL run's fingerprint (algorithm, hparams, model) plus what the data position means: the corpus and its packing."""
    from rlgraph.train.session import fingerprint

    return {**fingerprint(config), "corpus": str(Path(config.data.train)), "pretrain": json.dumps(config.pretrain.model_dump())}


def _refuse_other_corpus(config: TrainConfig, checkpoint: Path) -> None:
    """A checkpoint's data position means something only for its corpus, packing, algorithm and model."""
    from rlgraph.backends.local.state import CheckpointMismatch
    from rlgraph.train.checkpoint import read_extra

    saved, mine = read_extra(checkpoint).get("user", {}).get("fingerprint"), _fingerprint(config)
    if saved is not None and saved != mine:
        diffs = [f"{key}: checkpoint {saved.get(key)!r}, this run {mine.get(key)!r}"
                 for key in sorted(set(saved) | set(mine)) if saved.get(key) != mine.get(key)]
        raise CheckpointMismatch(f"checkpoint {checkpoint} was written by another run ({'; '.join(diffs)})")
