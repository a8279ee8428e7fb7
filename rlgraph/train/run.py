"""`rlgraph train`: a run on your own model, data and rewards, from one config.

    prepare(config)  -> Setup     tokenizer, prompt splits, rewards, the compiled RL and eval plans
    world_of_config(setup)        the roles as one recipe (`WorldSpec`): local builds it in this process
                                  (`build_roles`, `add_rl_roles`), spmd/ray workers on their ranks
    Run(config)                   the run opened: prepared, roles built, warm-started, runners started;
                                  `step()` -> one RL step's metrics, `finish()` -> the final evaluation
    train(config)                 a `Run` stepped to train.steps / train.seconds: metrics, evaluation,
                                  checkpoints, logs; `resume=True` continues a run exactly

Every step is one run of a compiled plan by the `PlanRunner` (the plan is the truth), on every
runtime: each RL step, each warm-start step (the `sft` plan) and each evaluation (the `evaluate`
plan). This module is the run's entry and its resume checks; `setup.py` prepares (data, rewards,
plans), `roles.py` reads the roles' settings from the config, `recipe.py` is the one role recipe
(local: built here; spmd/ray: by the workers), `session.py` drives the warm start, the runners
and the loop, and `user_code.py` loads what the config names.
The run directory holds `config.yaml` (resolved), `plan.txt`, `metrics.jsonl`, `tensorboard/`,
`step-*/` checkpoints, `plots/*.png` and `summary.json`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import torch
from rich.console import Console

from rlgraph.backends.local.state import CheckpointMismatch
from rlgraph.errors import ConfigError
from rlgraph.train.checkpoint import (
    abandon_later_checkpoints, claim_file, later_checkpoints, refuse_foreign, resume_point,
)
from rlgraph.train.config import TrainConfig, load_config
from rlgraph.train.loop import RunResult
from rlgraph.train.manifest import claim, remove_owned, verify_recorded
from rlgraph.train.recipe import add_rl_roles, build_roles, rebase_lora
from rlgraph.train.roles import BASE_FILE
from rlgraph.train.session import _Session, data_digest, fingerprint
from rlgraph.train.setup import Setup, prepare
from rlgraph.train.user_code import resolved_hparams


# -- the run --------------------------------------------------------------------------------------
def dry_run(config: TrainConfig, console: Console | None = None) -> Setup | None:
    """Print the data report, the compiled plan and its memory per rank; build and run nothing."""
    console = console or Console()
    if config.algorithm.name == "pretrain":  # raw text, no prompts or rewards: its own plan (train/pretraining.py)
        from rlgraph.train.pretraining import check_pretrain_config, compile_pretrain
        from rlgraph.runtime.worker_pool import resolve_device

        check_pretrain_config(config)
        console.print(compile_pretrain(config, str(resolve_device(config.runtime.device))).as_text(), markup=False,
                      highlight=False, soft_wrap=True)
        return None
    setup = prepare(config)
    # soft_wrap: a plan line is never broken, whatever the width (rich assumes 80 columns off a terminal)
    for report in setup.reports:
        console.print(report.summary(), soft_wrap=True)
    console.print(f"train prompts {len(setup.train_rows)}, eval prompts {len(setup.eval_rows)}")
    _warn_tokenizer(setup, console)
    console.print(setup.rl.as_text(), markup=False, highlight=False, soft_wrap=True)
    return setup


def train(config: TrainConfig, *, resume: bool = False, checkpoint: str | int | None = None,
          console: Console | None = None, overwrite: bool = False) -> RunResult:
    """Run `config` in `config.directory`; with `resume`, continue from its latest checkpoint, or from
    `checkpoint` (a step number or step-* name), whose later checkpoints are then deleted. A fresh run
    into a directory holding files rlgraph did not write is refused unless `overwrite` (or the
    config's `overwrite: true`)."""
    if config.algorithm.name == "pretrain":  # continued pre-training on raw text (train/pretraining.py)
        from rlgraph.train.pretraining import train_pretrain

        return train_pretrain(config, resume=resume, checkpoint=checkpoint, console=console, overwrite=overwrite)
    with Run(config, resume=resume, checkpoint=checkpoint, console=console, overwrite=overwrite) as run:
        seconds = run.session.loop(run.trainer)
        return run.finish(seconds)


class Run:
    """`train()` a step at a time. Opening prepares `config` (the compiled plans), builds the roles
    (local; on spmd/ray the workers build them from the recipe), warm-starts, starts the runners and
    logs step 0; `step()` runs the compiled RL plan once and returns the step's metrics (logged, and
    checkpointed every `checkpoint.every`); `finish()` checkpoints the last step, runs the final
    evaluation and writes summary.json (and the plots); leaving the `with` releases the workers and
    the log files (also on an error, with no summary).

        with Run(config) as run:
            for _ in range(10):
                print(run.step()["reward"])
            result = run.finish()
    """

    def __init__(self, config: TrainConfig, *, resume: bool = False, checkpoint: str | int | None = None,
                 console: Console | None = None, overwrite: bool = False) -> None:
        from rlgraph.train.logging import METRICS_FILE, SAMPLES_FILE, MetricLogger, SampleLog, make_sinks

        self.console = console = console or Console()
        run_dir = self.run_dir = config.directory
        if checkpoint is not None and not resume:
            raise ConfigError(f"--checkpoint {checkpoint}: a checkpoint to start from is only taken with --resume",
                              fix=f"rlgraph train --resume {run_dir} --checkpoint {checkpoint}")
        checkpoint = resume_point(run_dir, checkpoint) if resume else None
        later = later_checkpoints(run_dir, checkpoint) if checkpoint is not None else []  # refused now if not ours
        if not resume:
            refuse_foreign(run_dir, overwrite or config.overwrite)
        if checkpoint is not None:
            _refuse_other_run(config, checkpoint)  # before anything is compiled or built
        torch.manual_seed(config.train.seed)
        setup = self.setup = prepare(config)
        for report in setup.reports:
            console.print(report.summary())
        _warn_tokenizer(setup, console)
        if checkpoint is not None:
            _refuse_other_data(setup, checkpoint)
        run_dir.mkdir(parents=True, exist_ok=True)
        logging = config.logging
        claim(run_dir, "plan.txt", METRICS_FILE, SAMPLES_FILE, *(["tensorboard"] if logging.tensorboard else []),
              *(["wandb"] if logging.wandb is not None else []))  # before writing: a crash leaves nothing unrecorded
        (run_dir / "config.yaml").write_text(setup.config.to_yaml())  # resolved: the algorithm's defaults written out
        claim_file(run_dir, "config.yaml")  # read back by resume, eval and export: recorded with its sha256
        (run_dir / "plan.txt").write_text(setup.rl.as_text() + "\n")
        if checkpoint is None and (run_dir / BASE_FILE).exists():  # a fresh run: no base of an earlier attempt here
            remove_owned(run_dir, run_dir / BASE_FILE)  # refuse_foreign made sure it is rlgraph's
            console.print(f"removed {run_dir / BASE_FILE}: the LoRA base an earlier attempt of this run wrote")
        # The local runtime builds the models here; spmd/ray workers build them from the config's recipe.
        self.executor = build_roles(setup) if config.runtime.runtime == "local" else None
        self.session = session = _Session(setup, self.executor, console)
        self.logger: MetricLogger | None = None
        self._closed = False
        try:
            self.trainer = _start(session, setup, self.executor, checkpoint, run_dir, console, later)
            resume_step = self.trainer.step if checkpoint else None
            sinks = make_sinks(run_dir, tensorboard=config.logging.tensorboard, wandb=config.logging.wandb,
                               mlflow=config.logging.mlflow, resume_step=resume_step)
            self.logger = session.logger = MetricLogger(sinks)
            session.samples = SampleLog(run_dir / SAMPLES_FILE, resume_step=resume_step)
            if checkpoint is None and (setup.eval_rows or session.warm):
                self.logger.log(0, session.first_row())
        except BaseException:
            self.close()  # the reward workers a warm start's evaluation started, the sinks opened
            raise

    @property
    def steps(self) -> int:
        """RL steps done (a resumed run counts its earlier ones)."""
        return self.trainer.step

    def step(self) -> dict[str, float]:
        """One RL step: the compiled plan run once on the next batch; its metrics, as logged."""
        return self.trainer.run_step()

    def finish(self, seconds: float = 0.0) -> RunResult:
        """The run's end: the last step checkpointed, the final evaluation logged, the workers and
        logs closed, summary.json (and the plots) written; `seconds` is the RL loop's wall time."""
        self.session.finish(self.trainer)
        self.close()
        result = RunResult(self.run_dir, self.trainer.step, seconds, self.session.first_eval, self.session.last_eval)
        claim(self.run_dir, "summary.json", *(["plots"] if self.setup.config.logging.plots else []))
        # allow_nan=False: a NaN that reached this far is a bug to see, never a "NaN" in the summary
        (self.run_dir / "summary.json").write_text(json.dumps({k: str(v) if isinstance(v, Path) else v
                                                               for k, v in attrs.asdict(result).items()}, indent=1,
                                                              allow_nan=False))
        if self.setup.config.logging.plots:
            from rlgraph.train.plot import plot_run

            plot_run(self.run_dir)
        return result

    def close(self) -> None:
        """Release the workers, the reward processes and the log files; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self.logger is not None:
            self.logger.close()
        self.session.close()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _start(session: _Session, setup: Any, executor: Any, checkpoint: Any, run_dir: Path, console: Console,
           later: list[Path]) -> Any:
    """The warm start (a fresh run), the RL roles and the trainer, resumed from `checkpoint` if given."""
    config = setup.config
    if checkpoint is None:
        session.warm_start(run_dir)
        if executor is not None and config.model.lora is not None and config.warm_start.steps:
            rebase_lora(setup, executor)  # on spmd/ray the workers wrote the merged base themselves
        session.first_eval = None  # "before" is the policy RL starts from, not the one SFT started from
    if executor is not None:
        add_rl_roles(setup, executor)
        session.reset_optimizer()
    trainer = session.trainer(run_dir)  # the runners (and worker processes, on spmd/ray) start here
    if checkpoint is not None:
        trainer.resume(checkpoint)  # read and verified whole before `latest` or any later checkpoint is touched
        for gone in abandon_later_checkpoints(run_dir, checkpoint, later):
            console.print(f"deleted {gone.name}: a later checkpoint of the branch this resume from {checkpoint.name} abandons")
        console.print(f"resumed {run_dir} at step {trainer.step} ({checkpoint.name})")
    return trainer


def _warn_tokenizer(setup: Setup, console: Console) -> None:
    """Say when the run starts, not after it trained, that `rlgraph export` will refuse its tokenizer
    (AutoTokenizer would load it differently beside this model's config.json)."""
    from rlgraph.backends.local.models import model_tokenizer_mismatch
    from rlgraph.plan.presets import preset_names

    if setup.config.model.path in preset_names():
        return  # a preset has no config.json: nothing is exported
    problem = model_tokenizer_mismatch(setup.tokenizer, setup.config.model.path)
    if problem:
        console.print(f"warning: rlgraph export will refuse this run's tokenizer: {problem}", markup=False,
                      highlight=False)


def _refuse_other_run(config: TrainConfig, checkpoint: Path) -> None:
    """A checkpoint of another algorithm or model is refused before anything is loaded."""
    from rlgraph.train.checkpoint import read_extra

    saved = read_extra(checkpoint).get("user", {}).get("fingerprint")
    mine = fingerprint(config)
    if saved is not None and saved.get("algorithm") == mine["algorithm"]:  # written before hparams were resolved
        hparams = resolved_hparams(config.algorithm.name, json.loads(saved["hparams"]))
        saved = {**saved, "hparams": json.dumps(hparams, sort_keys=True, default=str)}
    if saved is not None and saved != mine:
        diffs = [f"{key}: checkpoint {saved.get(key)!r}, this run {mine.get(key)!r}"
                 for key in sorted(set(saved) | set(mine)) if saved.get(key) != mine.get(key)]
        raise CheckpointMismatch(f"checkpoint {checkpoint} was written by another run ({'; '.join(diffs)})")


def _refuse_other_data(setup: Setup, checkpoint: Path) -> None:
    """A checkpoint's data position means something only for the prompts it was taken over: a
    resume over other usable prompts (a changed file, field mapping, template or length limit) is
    refused, naming what differs, instead of silently replaying other batches."""
    from rlgraph.train.checkpoint import read_extra

    user = read_extra(checkpoint).get("user", {})
    base = setup.config.directory / BASE_FILE
    if user.get("lora_base") and not base.is_file():
        raise CheckpointMismatch(f"checkpoint {checkpoint} holds LoRA adapters of a warm-started base, but "
                                 f"{base} is gone: they cannot be applied to another base")
    if setup.config.model.lora is not None and not user.get("lora_base") and base.exists():
        raise CheckpointMismatch(f"checkpoint {checkpoint} holds LoRA adapters of {setup.config.model.path}, but {base} "
                                 f"appeared since it was saved and the policy would be built on it; move {base} away, "
                                 "then resume")
    saved = user.get("data")
    mine = data_digest(setup.train_rows)
    if saved is not None and saved != mine:
        raise CheckpointMismatch(
            f"checkpoint {checkpoint} was taken over other training prompts: {saved['prompts']} usable prompts "
            f"(digest {saved['sha256'][:12]}), data.train {setup.config.data.train} now gives {mine['prompts']} "
            f"(digest {mine['sha256'][:12]}); the data position it saved would replay other batches\n"
            "  fix: resume with the data the run started with, or start a new run (model.path can point at an export)")


def load_run_config(run_dir: str | Path, overrides: list[str] = ()) -> TrainConfig:
    """The resolved config a run saved (`RUN_DIR/config.yaml`), with `overrides`."""
    import yaml

    from rlgraph.train.checkpoint import file_sha256

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a run directory: it has no config.yaml", fix="pass the directory rlgraph train wrote")
    verify_recorded(run_dir, "config.yaml", file_sha256,
                    fix="restore the file rlgraph wrote; change settings with overrides instead "
                        f"(rlgraph train --resume {run_dir} -o key=value), which are recorded")
    config = load_config(None, overrides, base=yaml.safe_load(path.read_text()))
    return config.model_copy(update={"run_dir": str(run_dir)})
