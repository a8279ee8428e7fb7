"""One run's session: the warm start, the evaluations, the runners over the chosen transport (local,
spmd, Ray) and the loop that steps the compiled plan, logging each step's metrics and samples."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from rlgraph.backends.local.executor import LocalExecutor
from rlgraph.data.prompts import to_demonstrations
from rlgraph.data.sampler import Sampler
from rlgraph.plan.timing import COMPILE_SECONDS, STEP_SECONDS, seconds_by_kind, stage_metric
from rlgraph.runtime.plan_runner import PlanRunner
from rlgraph.train.config import TrainConfig
from rlgraph.train.logging import report_reward_failures
from rlgraph.train.loop import Trainer
from rlgraph.train.checkpoint import claim_file
from rlgraph.train.manifest import claim, owns, remove_owned
from rlgraph.train.roles import BASE_FILE, lr_factor, role_optimizer
from rlgraph.train.setup import Setup, warm_plan
from rlgraph.train.user_code import accuracy_metric, resolved_hparams


class _Session:
    """One run's moving parts: runners, samplers, evaluation and per-step metrics. `executor` holds the
    models on the local runtime; on spmd/ray it is None: the workers build them (`world_of_config`)."""

    def __init__(self, setup: Setup, executor: LocalExecutor | None, console: Console, *, training: bool = True):
        self.setup, self.config, self.executor, self.console = setup, setup.config, executor, console
        self.sampler = Sampler(setup.train_rows, setup.config.rollout.prompts_per_step, seed=setup.config.train.seed)
        self.data_digest = data_digest(setup.train_rows)  # saved with each checkpoint: a resume needs the same prompts
        self.runner: PlanRunner | None = None
        self.eval_runner: PlanRunner | None = None
        self.warm_runners: tuple[PlanRunner, PlanRunner] | None = None  # the warm start's sft and evaluation runners
        self.transport: Any = None
        self._start_weights: Path | None = None  # spmd/ray: the directory of the warm-started policy's file
        self._warm_weights: Path | None = None  # spmd/ray: that file (or a LoRA run's base), once written
        self.world: Any = None  # spmd/ray: the RL workers' recipe
        self.logger: Any = None
        self.samples: Any = None  # the run's SampleLog (samples.jsonl)
        self.step = 0  # the RL step whose samples an evaluation logs
        self.warm: dict[str, float] = {}  # the warm start's metrics, logged in the first row
        self.first_eval: float | None = None
        self.last_eval: float | None = None
        self._stage_seconds: dict[str, float] = {}
        self._busy_before: dict[int, float] = {}  # spmd/ray: `_rank_busy()` when the step began
        if training:  # the decision is about the RL rollouts' shape: `rlgraph eval` runs none
            self.announce_decode()
        setup.rewards.start()  # the reward workers import while the models warm up
        # Asynchronous RL: the reward terms' metrics of each batch generated and not trained yet, by batch
        # number (batch i is trained at step i+1; it was scored one or more steps before).
        self.batch_terms: dict[int, dict[str, float]] = {}

    def announce_decode(self) -> None:
        """Say at start whether the rollouts' decode step compiles (`generation.compile`) and why."""
        rollout, sizes = self.config.rollout, self.setup.rl.plan.sizes
        if self.executor is None:  # spmd/ray: rollouts and evaluations run on the workers, which decide per shape
            self.console.print(f"generation.compile={self.config.generation.compile}: the {self.config.runtime.runtime} "
                               "workers decide per shape of their rows (their compile time is in the step time)",
                               markup=False, highlight=False, soft_wrap=True)
            return
        policy = self.executor.models["policy"].model
        decision = self.executor.decode_decision(policy, rollout.prompts_per_step * rollout.n, sizes.get("P", 1),
                                                 rollout.max_new_tokens)
        self.console.print(f"generation.compile={self.config.generation.compile}: {decision.text()}",
                           markup=False, highlight=False, soft_wrap=True)

    def _compile_seconds(self) -> float:
        """Seconds of decode compiles since the last call (the local executor's; none on spmd/ray)."""
        return self.executor.decode_ledger.pop_seconds() if self.executor is not None else 0.0

    def next_batch(self) -> Any:
        return self.setup.prompts(self.sampler.next_batch())

    def trainer(self, run_dir: Path) -> Trainer:
        """The RL and eval plan runners over this process (local) or worker processes (spmd, ray)."""
        if self.executor is not None:
            self.runner = PlanRunner(self.setup.rl, self.executor)
            self.eval_runner = PlanRunner(self.setup.eval, self.executor)
        else:  # the workers build every role from the config's recipe, from the warm start's weights if any
            from rlgraph.train.recipe import world_of_config

            self.world = world_of_config(self.setup, start=self._warm_weights)
            self.transport, controller = self._start_workers(self.world, self.setup.rl.plan)
            self.runner = PlanRunner(self.setup.rl, self.transport, controller=controller)
            self.eval_runner = PlanRunner(self.setup.eval, self.transport, controller=controller)
        if self.setup.rl.plan.overlap is not None:
            self.runner.on_rollout = self.scored
        checkpoint = self.config.checkpoint
        return Trainer(self.runner, self.next_batch, self.sampler, run_dir=run_dir,
                       checkpoint_every=checkpoint.every, keep_last=checkpoint.keep_last,
                       before_step=self.before_step, after_step=self.after_step,
                       extra_state=lambda: {"fingerprint": fingerprint(self.config),
                                            "data": self.data_digest, "config": self.config.to_yaml(),
                                            "lora_base": (run_dir / BASE_FILE).is_file(),
                                            "eval_before": self.first_eval,
                                            "batch_terms": [[batch, terms] for batch, terms in self.batch_terms.items()]},
                       load_extra=lambda user: self.keep_first_eval(user, run_dir))

    def keep_first_eval(self, user: dict[str, Any], run_dir: Path) -> None:
        """On resume: the run's first evaluation stays its "before" figure (summary.json, the console),
        as in the uninterrupted run; a checkpoint without it (older runs) has it in metrics.jsonl at step 0."""
        self.batch_terms = {int(batch): dict(terms) for batch, terms in user.get("batch_terms", [])}
        if "eval_before" in user:
            self.first_eval = user["eval_before"]
            return
        path = run_dir / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
        self.first_eval = next((row["eval/accuracy"] for row in rows if row.get("step") == 0 and "eval/accuracy" in row),
                               None)

    def start_weights(self, run_dir: Path) -> Path:
        """Where the workers write the warm-started policy the RL workers start from (removed at `close`:
        a resume starts from a checkpoint, and a 7B policy's fp32 start is ~28 GB of disk)."""
        self._start_weights = run_dir / "start_weights"
        if not self._start_weights.exists():
            claim(run_dir, self._start_weights.name)
        return self._start_weights

    def _start_workers(self, world: Any, plan: Any) -> tuple[Any, LocalExecutor]:
        """Worker processes (spmd) or actors (ray) building `world`'s roles as `plan` places them, and
        the controller's executor: the rewards and the tokenizer, no model."""
        runtime = self.config.runtime
        self.console.print(f"starting {runtime.nproc} {runtime.runtime} workers ({self.setup.device}) ...")
        if runtime.runtime == "ray":
            from rlgraph.runtime.ray_transport import RayTransport

            transport = RayTransport(plan, world, address=runtime.address, device=self.setup.device,
                                     timeout_s=runtime.timeout_s)
        else:
            from rlgraph.runtime.spmd import SpmdTransport

            transport = SpmdTransport(plan, world, device=self.setup.device, timeout_s=runtime.timeout_s)
        controller = world.controller()
        controller.rewards["reward"].fn = self.setup.rewards  # the same pipeline object: its metrics are read here
        return transport, controller

    def close(self) -> None:
        self.setup.rewards.close()  # the reward worker processes, with whatever their rewards started
        if self.transport is not None:
            self.transport.close()
        if self._start_weights is not None and self._start_weights.exists() and owns(self._start_weights.parent,
                                                                                   self._start_weights.name):
            remove_owned(self._start_weights.parent, self._start_weights)  # never a start_weights/ of the user's
        if self.samples is not None:
            self.samples.close()

    # -- warm start ---------------------------------------------------------------------------
    def warm_start(self, run_dir: Path) -> None:
        """SFT on the answers until `warm_start.steps` or the target held-out accuracy, as runs of the
        compiled `sft` plan (and the `evaluate` plan between its steps) by the plan runner: over the
        run's executor in this process (local; RL then starts from the policy in memory), or over
        workers that hold only the policy (spmd/ray), which then write the warm-started policy (a
        LoRA run's merged base, RUN_DIR/base.safetensors) for the RL workers to start from, and stop."""
        warm = self.config.warm_start
        if not warm.steps:
            return
        rows = [row for row in self.setup.train_rows if row.answer is not None]
        sampler = Sampler(rows, min(warm.batch_size, len(rows)), seed=self.config.train.seed + 1)
        transport, plan = None, warm_plan(self.setup)
        if self.executor is not None:  # the run's executor, its policy trained at the warm start's rate
            worker = self.executor.models["policy"]
            worker.optimizer = role_optimizer(self.config, worker.model, warm.lr)
            train, evaluation = PlanRunner(plan, self.executor), PlanRunner(self.setup.eval, self.executor)
        else:
            from rlgraph.train.recipe import world_of_config

            world = world_of_config(self.setup, roles=("policy",), lr=warm.lr)
            transport, controller = self._start_workers(world, self.setup.eval.plan)  # the policy: trained, generating
            train = PlanRunner(plan, transport, controller=controller)
            evaluation = PlanRunner(self.setup.eval, transport, controller=controller)
        self.warm_runners = (train, evaluation)
        from rlgraph.train.progress import RunProgress

        try:
            start, accuracy = time.perf_counter(), None
            demonstrations = self._demonstrations()
            with RunProgress(total_steps=warm.steps, console=self.console, enabled=self.config.logging.progress,
                             label="SFT") as progress:
                for step in range(1, warm.steps + 1):
                    began = time.perf_counter()
                    train.run(demonstrations(sampler.next_batch()))
                    shown = {STEP_SECONDS: time.perf_counter() - began}
                    if warm.target_accuracy and self.setup.target_rows and step % warm.eval_every == 0:
                        accuracy = self.evaluate(evaluation, self.setup.target_rows)["eval/accuracy"]
                        shown["eval/accuracy"] = accuracy
                    progress.update(step, shown)
                    if accuracy is not None and accuracy >= warm.target_accuracy:
                        break
            if transport is not None:
                self._warm_weights = Path(transport.save_weights("policy", str(self._warm_file(run_dir))))
                if self._warm_weights.name == BASE_FILE:  # the workers wrote it; the controller records it
                    claim_file(run_dir, BASE_FILE)
        finally:
            if transport is not None:
                transport.close()
        dev = self.setup.warm_eval_rows
        shown = ("" if accuracy is None else f", held-out accuracy {accuracy:.1%}" if dev is None
                 else f", accuracy {accuracy:.1%} on the {len(dev)} warm_start.eval prompts")
        self.console.print(f"warm start: {step} SFT steps in {time.perf_counter() - start:.1f} s{shown}")
        self.warm = {"warm_start/steps": float(step), "time/warm_start_s": time.perf_counter() - start}

    def _warm_file(self, run_dir: Path) -> Path:
        """Where the workers write the warm-started policy: a LoRA run's merged base (kept: its checkpoints'
        adapters apply to it), else a start-up file removed when the run ends."""
        if self.config.model.lora is not None:
            return run_dir / BASE_FILE
        return self.start_weights(run_dir) / "policy.safetensors"

    def _demonstrations(self) -> Any:
        """rows -> an SFT batch: the answers, or with `warm_start.trace_field` multi-turn traces whose
        observations are rendered as the rollouts render them (context, never targets)."""
        field, tokenizer = self.config.warm_start.trace_field, self.setup.tokenizer
        if field is None and self.setup.images is not None:  # a vision run: the prompts keep their images
            return self.setup.images.demonstrations
        if field is None:
            return lambda rows: to_demonstrations(rows, tokenizer)
        from rlgraph.agents.demonstrations import trace_demonstrations
        from rlgraph.agents.env import observation_format

        format = observation_format(self.setup.env(), tokenizer) if self.setup.env is not None else None
        return lambda rows: trace_demonstrations(rows, tokenizer, field, format)

    def first_row(self) -> dict[str, float]:
        """Step 0: the held-out evaluation of the policy RL starts from, which after a warm start is its
        accuracy (`warm_start/accuracy`, also printed), and the warm start's own metrics."""
        row = {**self.warm, **(self.evaluate() if self.setup.eval_rows else {})}
        row[COMPILE_SECONDS] = self._compile_seconds()  # the evaluation's decode compiles
        if self.warm and "eval/accuracy" in row:
            row["warm_start/accuracy"] = row["eval/accuracy"]
            self.console.print(f"warm start: held-out accuracy {row['eval/accuracy']:.1%} "
                               f"({len(self.setup.eval_rows)} prompts)")
        return row

    def pop_rewards(self, kind: str) -> dict[str, float]:
        """The reward terms' metrics since the last call; their kept samples go to samples.jsonl, and
        a term that failed on every sample is warned about loudly."""
        samples = self.setup.rewards.pop_samples()
        if self.samples is not None and samples:
            self.samples.log(self.step, kind, samples)
        terms = self.setup.rewards.pop_metrics()
        report_reward_failures(self.step, kind, self.setup.rewards.last_failures, self.console)
        return terms

    def log_transcripts(self, runner: Any, kind: str) -> None:
        """Multi-turn runs: the first `logging.samples` episodes the plan handed back (its `rollouts`,
        `episodes` and `turn_rewards` outputs, of the batch this step trained) go to samples.jsonl."""
        outputs, limit = runner.outputs, self.config.logging.samples
        if self.samples is None or not limit or "rollouts" not in outputs:
            return
        from rlgraph.agents.transcripts import transcripts

        self.samples.log(self.step, kind, transcripts(outputs["rollouts"], outputs["episodes"], outputs["turn_rewards"],
                                                      self.setup.tokenizer, limit))

    def scored(self, batch: int) -> None:
        """Asynchronous RL: batch `batch`'s rollout lane has run; keep its reward terms for its step."""
        self.batch_terms[batch] = self.pop_rewards("train")

    def reset_optimizer(self) -> None:
        """RL starts a fresh optimizer at `optimizer.lr` from the warm-started weights (on spmd/ray
        the RL workers build theirs fresh from the recipe)."""
        if self.executor is None:
            return
        worker = self.executor.models["policy"]
        worker.optimizer = role_optimizer(self.config, worker.model, self.config.optimizer.lr)

    # -- steps --------------------------------------------------------------------------------
    def before_step(self, step: int) -> None:
        factor = lr_factor(self.config, step)
        roles = self.executor.models if self.executor is not None else self.world.roles
        for role, base in (("policy", self.config.optimizer.lr),
                           ("critic", self.config.optimizer.critic_lr or self.config.optimizer.lr)):
            # On spmd/ray the optimizers that step live in the workers: the schedule goes to them.
            target = self.transport if self.transport is not None else self.executor
            if role in roles:
                target.set_learning_rate(role, base * factor)
        self.setup.rewards.pop_metrics()  # what an evaluation left behind is not this step's
        self._busy_before = self._rank_busy()

    def _rank_busy(self) -> dict[int, float]:
        """spmd/ray: plan step index -> seconds the busiest rank has spent on that step's commands so far
        (the transports pipeline commands, so the controller's clock sees only where it waits)."""
        return self.transport.busy_seconds() if self.transport is not None else {}

    def after_step(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """The plan's metrics plus the reward terms, accuracy, throughput, stage times and evaluation."""
        metrics, self.step = dict(metrics), step
        # Asynchronous RL: the terms of the batch trained (scored when it was generated), not the newest
        terms = self.batch_terms.pop(step - 1) if self.runner.on_rollout is not None else self.pop_rewards("train")
        self.log_transcripts(self.runner, "train")
        metrics.update(terms)
        accuracy = terms.get(f"reward/{accuracy_metric(self.config)}")
        if accuracy is not None:
            metrics["accuracy"] = accuracy
        metrics["lr"] = self.config.optimizer.lr * lr_factor(self.config, step - 1)
        rows = self.config.rollout.prompts_per_step * self.config.rollout.n * metrics.get("filter/rounds", 1.0)
        # Decode compiles (generation.compile) are reported apart: time/step_s is the step's wall time,
        # compile included; the throughputs are of the step without them.
        compile_seconds = self._compile_seconds()
        seconds = metrics[STEP_SECONDS] - compile_seconds
        metrics["samples_per_s"] = rows / seconds
        if "response_length/mean" in metrics:
            metrics["tokens_per_s"] = rows * metrics["response_length/mean"] / seconds
        metrics.update(self._stage_times())
        every = self.config.eval.every
        if self.setup.eval_rows and every and step % every == 0:
            metrics.update(self.evaluate())
        metrics[COMPILE_SECONDS] = compile_seconds + self._compile_seconds()  # and the evaluation's
        if self.logger is not None:  # before the step's checkpoint: a run killed after it has its metrics
            self.logger.log(step, metrics)
        return metrics

    def _stage_times(self) -> dict[str, float]:
        """Seconds of this step in each kind of plan step (generate, train, reward, ...): on spmd/ray a
        worker step's are the busiest rank's own (`time/sync_weights_s` is the ranks' sync), measured
        since `before_step` (evaluations between steps run on the same ranks); the controller's
        steps, and every step on the local runtime, are the controller's clock."""
        steps = self.setup.rl.plan.steps
        totals = seconds_by_kind(steps, self.runner.step_seconds)
        out = {stage_metric(kind): seconds - self._stage_seconds.get(kind, 0.0) for kind, seconds in totals.items()}
        self._stage_seconds = totals
        busy, before = self._rank_busy(), self._busy_before
        ranks = seconds_by_kind([step for step in steps if step.index in busy],
                                {index: seconds - before.get(index, 0.0) for index, seconds in busy.items()})
        out.update({stage_metric(kind): seconds for kind, seconds in ranks.items()})
        return out

    def evaluate(self, runner: Any = None, rows: list | None = None) -> dict[str, float]:
        """Greedy decoding of the held-out prompts (or `rows`: the warm start's dev split) through the
        evaluate plan (in this process on the local runtime; on the workers, from the live policy, on
        spmd/ray): accuracy and reward."""
        runner = runner or self.eval_runner
        runner.versions.clear()  # the RL plan moved the policy on since: ask for the live version
        self.setup.rewards.pop_metrics()
        prompts = self.setup.prompts(self.setup.eval_rows if rows is None else rows)
        _, metrics = runner.run(prompts)
        terms = self.pop_rewards("eval")
        self.log_transcripts(runner, "eval")
        accuracy = terms.get(f"reward/{accuracy_metric(self.config)}", metrics["accuracy"])
        self.first_eval = accuracy if self.first_eval is None else self.first_eval
        self.last_eval = accuracy
        return {"eval/accuracy": accuracy, "eval/reward": metrics["accuracy"],
                "eval/response_length": metrics["response_tokens"]}

    def loop(self, trainer: Trainer) -> float:
        """Step `trainer` to `train.steps` or `train.seconds` under the progress bar; the loop's seconds."""
        from rlgraph.train.progress import RunProgress

        train, start = self.config.train, time.perf_counter()
        self.step = trainer.step  # a resumed run's final evaluation belongs to its step
        remaining = None if train.steps is None else max(train.steps - trainer.step, 0)
        with RunProgress(total_steps=train.steps, seconds=train.seconds, console=self.console,
                         enabled=self.config.logging.progress, start_step=trainer.step,
                         history=self._history(trainer)) as progress:
            for metrics in trainer.run(steps=remaining, seconds=train.seconds) if remaining != 0 else ():
                progress.update(trainer.step, metrics)
        return time.perf_counter() - start

    def _history(self, trainer: Trainer) -> list[dict]:
        """A resumed run's metrics rows up to its step (metrics.jsonl, cut back to the checkpoint by the
        logger), so the progress line's smoothing goes on from them; none for a fresh run."""
        from rlgraph.train.logging import METRICS_FILE, read_metrics

        if not trainer.step or trainer.run_dir is None or not (Path(trainer.run_dir) / METRICS_FILE).is_file():
            return []
        return [row for row in read_metrics(trainer.run_dir) if row.get("step", 0) <= trainer.step]

    def finish(self, trainer: Trainer) -> None:
        """The run's end: the last step checkpointed (whatever `checkpoint.every`), the final evaluation."""
        self.step = trainer.step  # a resumed run's final evaluation belongs to its step
        if trainer.step % self.config.checkpoint.every:
            trainer.save()  # the last step is always checkpointed
        if self.setup.eval_rows and (not self.config.eval.every or trainer.step % self.config.eval.every):
            final = self.evaluate()
            final[COMPILE_SECONDS] = self._compile_seconds()  # the evaluation's decode compiles
            self.logger.log(trainer.step, final)


def data_digest(rows: list) -> dict[str, Any]:
    """The usable training prompts, summarised: their count and a sha256 of their text, answer and fields."""
    import hashlib

    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps([row.text, row.answer, row.fields], sort_keys=True, default=str).encode())
    return {"prompts": len(rows), "sha256": digest.hexdigest()}


def fingerprint(config: TrainConfig) -> dict[str, str]:
    """What a checkpoint must agree on to be resumed: the algorithm, its hyper-parameters, the model."""
    return {"algorithm": config.algorithm.name,
            "hparams": json.dumps(resolved_hparams(config.algorithm.name, config.algorithm.hparams), sort_keys=True,
                                  default=str),
            "rollout": json.dumps(config.rollout.model_dump(), sort_keys=True),
            "model": str(config.model.path), "lora": json.dumps(config.model.lora.model_dump() if config.model.lora else None)}
