"""`rlgraph train`: a run on your own model, data and rewards, from one config.

    prepare(config)  -> Setup     tokenizer, prompt splits, rewards, the compiled RL and eval plans
    build_roles(...) -> executor  the policy (LoRA or full), the reference, the critic, the rewards
    train(config)                 warm start, then the RL plan step after step: metrics, evaluation,
                                  checkpoints, logs; `resume=True` continues a run exactly

Every RL step is one run of the compiled plan by the `PlanRunner` (the plan is the truth); so is
every evaluation (the `evaluate` algorithm's plan). This module wires roles, data and the clock.
The run directory holds `config.yaml` (resolved), `plan.txt`, `metrics.jsonl`, `tensorboard/`,
`step-*/` checkpoints, `plots/*.png` and `summary.json`.
"""

from __future__ import annotations

import copy
import json
import math
import time
from pathlib import Path
from typing import Any

import attrs
import torch
from rich.console import Console

from rlgraph.algorithms import ALGORITHMS, evaluate, sft
from rlgraph.api import compile as compile_algorithm
from rlgraph.backends.local.critic import build_critic
from rlgraph.backends.local.executor import CheckpointMismatch, LMWorker, LocalExecutor, RewardWorker
from rlgraph.backends.local.models import build_causal_lm, load_tokenizer
from rlgraph.data.prompts import encode_texts, load_prompts, split_holdout, to_demonstrations, to_prompts
from rlgraph.data.sampler import Sampler
from rlgraph.ir.errors import ConfigError, RLGraphError
from rlgraph.rewards import RewardPipeline, RewardTerm, build_reward
from rlgraph.runtime.eager import Interpreter
from rlgraph.runtime.plan_runner import PlanRunner
from rlgraph.runtime.pool import resolve_device
from rlgraph.train.checkpoint import latest_checkpoint
from rlgraph.train.config import TrainConfig, load_config
from rlgraph.train.loop import Trainer


@attrs.define
class Setup:
    """What a run needs before any weight exists: enough for `--dry-run`."""

    config: TrainConfig
    tokenizer: Any
    train_rows: list
    eval_rows: list
    reports: list
    rewards: RewardPipeline
    rl: Any                 # Compiled: the RL algorithm's plan
    eval: Any               # Compiled: the evaluate algorithm's plan
    device: str


@attrs.frozen
class RunResult:
    run_dir: Path
    steps: int
    seconds: float
    eval_before: float | None
    eval_after: float | None


# -- setup ----------------------------------------------------------------------------------------
def prepare(config: TrainConfig) -> Setup:
    """Tokenizer, data, rewards and both plans; refuses a bad config before any model is built."""
    from rlgraph.cli import import_modules  # the same --import rules as every command

    import_modules(config.imports)
    if config.runtime.threads:
        torch.set_num_threads(config.runtime.threads)
    _check_model_path(config)
    tokenizer = _tokenizer(config)
    data = config.data
    options = dict(prompt_field=data.prompt_field, answer_field=data.answer_field, extra_fields=data.extra_fields,
                   chat_template=data.chat_template, system_prompt=data.system_prompt,
                   max_prompt_tokens=data.max_prompt_tokens, format=data.format, split=data.split)
    train_rows, train_report = load_prompts(data.train, tokenizer, **options)
    reports = [train_report]
    if data.eval is not None:
        eval_rows, eval_report = load_prompts(data.eval, tokenizer, **options)
        reports.append(eval_report)
    elif data.eval_fraction:
        train_rows, eval_rows = split_holdout(train_rows, data.eval_fraction, seed=config.train.seed)
    else:
        eval_rows = []
    if config.eval.max_prompts:
        eval_rows = eval_rows[: config.eval.max_prompts]
    if len(train_rows) < config.rollout.prompts_per_step:
        raise ConfigError(f"data.train {data.train}: {len(train_rows)} usable prompts, fewer than "
                          f"rollout.prompts_per_step={config.rollout.prompts_per_step}",
                          fix="add prompts or lower rollout.prompts_per_step")
    rewards = build_rewards(config)
    device = _device(config)
    prompt_len = max(map(len, encode_texts([row.text for row in train_rows], tokenizer)))
    rl, evaluation = _compile(config, device, prompt_len, len(eval_rows))
    return Setup(config, tokenizer, list(train_rows), list(eval_rows), reports, rewards, rl, evaluation, device)


def build_rewards(config: TrainConfig) -> RewardPipeline:
    """The config's reward terms as one pipeline; a bad name or option is a ConfigError naming the entry."""
    terms = []
    for index, reward in enumerate(config.rewards):
        where = f"rewards[{index}] ({reward.name})"
        spec = load_object(reward.name, f"{where}:") if ":" in reward.name else reward.name
        try:
            fn = build_reward(spec, **reward.options)
        except ConfigError as error:
            raise ConfigError(f"{where}: {error.summary}", fix=error.fix) from None
        missing = sorted(set(getattr(fn, "fields", ())) - {"answer", "text", *config.data.extra_fields})
        if missing:
            raise ConfigError(f"{where} reads the per-row field(s) {', '.join(missing)}, which the data does not pass",
                              fix=f"add them to data.extra_fields, e.g. extra_fields: [{', '.join(missing)}]")
        terms.append(RewardTerm(reward.name, fn, reward.weight))
    return RewardPipeline(terms, on_error=config.reward_on_error, timeout_s=config.reward_timeout_s)


def _device(config: TrainConfig) -> str:
    try:
        return resolve_device(config.runtime.device)
    except (ValueError, RLGraphError) as error:
        raise ConfigError(f"runtime.device {config.runtime.device!r}: {str(error).split('; use ')[0]}",
                          fix="set runtime.device: cpu, or auto (cuda when a GPU is present)") from None


def _check_model_path(config: TrainConfig) -> None:
    """`model.path` is a directory with a config.json (weights optional), a config.json file, or a
    preset name (`rlgraph plan` presets: a plan and its memory without weights)."""
    from rlgraph.plan.presets import preset_names

    path = config.model.path
    if path is None or path in preset_names():
        return
    source = Path(path)
    if not source.exists():
        raise ConfigError(f"model.path {path!r} does not exist",
                          fix="point it at a Hugging Face model directory (config.json and safetensors weights), "
                              "or leave it null for the shipped tiny Qwen2")
    if source.is_dir() and not (source / "config.json").is_file():
        raise ConfigError(f"model.path {path!r} is a directory without a config.json",
                          fix="point it at a directory written by model.save_pretrained(...)")


def _tokenizer(config: TrainConfig) -> Any:
    source = config.model.tokenizer or config.model.path
    if source is not None and not (Path(source) / "tokenizer.json").is_file():
        if config.model.tokenizer is not None:
            raise ConfigError(f"model.tokenizer {source!r} has no tokenizer.json",
                              fix="point it at a directory written by tokenizer.save_pretrained(...)")
        source = None  # a model directory without a tokenizer: the shipped one
    return load_tokenizer(source)


def _algorithm(name: str) -> Any:
    if name in ALGORITHMS:
        return ALGORITHMS[name]
    if ":" in name:  # a user's @rg.algorithm: "module:fn" or "file.py:fn"
        return load_object(name, "algorithm.name")
    from rlgraph.ir.errors import did_you_mean

    raise ConfigError(f"algorithm.name {name!r} is not an algorithm{did_you_mean(name, ALGORITHMS)}",
                      fix=f"one of {', '.join(sorted(ALGORITHMS))}, or 'my_module:my_algorithm'")


def _compile(config: TrainConfig, device: str, prompt_len: int, eval_prompts: int) -> tuple[Any, Any]:
    from rlgraph.cli import parse_placement
    from rlgraph.plan.mesh import Mesh, colocated

    rollout, runtime = config.rollout, config.runtime
    fixed = sorted({"n", "temperature", "max_new_tokens"} & set(config.algorithm.hparams))
    if fixed:
        raise ConfigError(f"algorithm.hparams sets {', '.join(fixed)}", fix="set them in the rollout section")
    hparams = {**config.algorithm.hparams, "n": rollout.n, "temperature": rollout.temperature,
               "max_new_tokens": rollout.max_new_tokens}
    ranks = runtime.nproc if runtime.runtime != "local" else 1
    mesh = Mesh("cpu" if device == "cpu" else "h100", 1, ranks)
    try:
        placement = parse_placement(runtime.placement)
    except (SystemExit, TypeError, ValueError) as error:
        raise ConfigError(f"runtime.placement {runtime.placement!r}: {str(error).removeprefix('rlgraph: ')}",
                          fix="e.g. colocated:offload=False, colocated:fsdp=2, split:policy=1,rollout=1, or auto") from None
    models = {"policy": config.model.path} if config.model.path else {}
    lora = {"policy": config.model.lora.model_dump()} if config.model.lora else None
    extra = {"lora": lora} if lora else {}
    sizes = {"B": rollout.prompts_per_step, "P": prompt_len, "T": rollout.max_new_tokens, "n": rollout.n}
    rl = compile_algorithm(_algorithm(config.algorithm.name), mesh=mesh, placement=placement, engine=runtime.engine,
                           sizes=sizes, models=models, **extra, **hparams)
    if lora and runtime.runtime != "local":
        from rlgraph.backends.fsdp.executor import check_views

        try:  # a LoRA policy's reference (its module, adapters off) must share its ranks: refused at compile time
            check_views({"ref": "policy"}, rl.plan)
        except ValueError as error:
            raise ConfigError(f"runtime.placement {runtime.placement!r}: {error}",
                              fix="colocated:offload=False, or a split giving ref the policy's group: "
                                  "split:policy=1,rollout=1,ref=policy") from None
    # Evaluation runs in this process on one device (with the latest weights pulled from the workers
    # on spmd/ray): a generate-only plan over the training workers would read an engine no
    # sync_weights step has loaded since the last update.
    eval_tokens = config.eval.max_new_tokens or rollout.max_new_tokens
    evaluation = compile_algorithm(evaluate, mesh=Mesh(mesh.device, 1, 1), placement=colocated(offload=False),
                                   engine="native", models=models,
                                   sizes={**sizes, "B": max(eval_prompts, 1), "n": 1, "T": eval_tokens},
                                   max_new_tokens=eval_tokens)
    return rl, evaluation


# -- roles ----------------------------------------------------------------------------------------
def build_roles(setup: Setup, policy: torch.nn.Module | None = None) -> LocalExecutor:
    """The executor over the policy (`build_policy`'s, or the module given) and the rewards;
    `add_rl_roles` adds the reference and critic the plan reads."""
    config = setup.config
    model = (policy if policy is not None else build_policy(config, setup.tokenizer)).to(setup.device)
    policy = LMWorker(model, _optimizer(config, model, config.optimizer.lr))
    executor = LocalExecutor({"policy": policy}, {"reward": RewardWorker(setup.rewards)}, setup.tokenizer,
                             max_new_tokens=config.rollout.max_new_tokens, seed=config.train.seed, device=setup.device)
    return executor


BASE_FILE = "base.safetensors"  # a LoRA run's base after its warm start (the adapters merged into it)


def build_policy(config: TrainConfig, tokenizer: Any) -> torch.nn.Module:
    """The policy as the run starts it: the model (seeded init for a config) and, with `model.lora`,
    its adapters (seeded too), so a run, its resume, its evaluation and its export build the same
    module. A LoRA run that warm-started keeps its merged base in RUN_DIR/base.safetensors: the
    adapters of its checkpoints apply to that base."""
    model = build_causal_lm(config.model.path, tokenizer=tokenizer, seed=config.train.seed)
    if config.model.lora is None:
        return model
    from rlgraph.backends.lora import LoraSettings, apply_lora

    base = config.directory / BASE_FILE
    if base.is_file():
        from safetensors.torch import load_file

        from rlgraph.train.checkpoint import load_weights

        load_weights(model, load_file(str(base)), base, strict=True)
    lora = config.model.lora
    return apply_lora(model, LoraSettings(lora.r, lora.alpha, lora.dropout, tuple(lora.target_modules)),
                      seed=config.train.seed)


def checkpoint_policy(config: TrainConfig, tokenizer: Any, path: Path) -> tuple[torch.nn.Module, int]:
    """(the policy as the run built it, with checkpoint `path`'s weights; the checkpoint's step).
    A LoRA checkpoint holds the adapters only: the base comes from `build_policy`."""
    from rlgraph.backends.lora import is_lora
    from rlgraph.train.checkpoint import load_weights, read_checkpoint

    state, step, _ = read_checkpoint(path)
    if "policy" not in state.roles:
        raise CheckpointMismatch(f"checkpoint {path} has no policy role (it has {', '.join(state.roles)})")
    model = build_policy(config, tokenizer)
    load_weights(model, dict(state.roles["policy"].model), path, strict=not is_lora(model))
    return model, step


def rebase_lora(setup: Setup, executor: LocalExecutor) -> None:
    """After a LoRA warm start: merge the trained adapters into the base (saved once as
    RUN_DIR/base.safetensors, atomically) and start RL from fresh adapters on it, so the KL
    reference (the base, adapters off) is the warm-started policy, still with no second copy."""
    import os

    from safetensors.torch import save_file

    from rlgraph.backends.lora import merged_state_dict

    merged = {name: tensor.detach().to("cpu").contiguous().clone()
              for name, tensor in merged_state_dict(executor.models["policy"].model).items()}
    path = setup.config.directory / BASE_FILE
    tmp = path.with_name(path.name + ".tmp")
    save_file(merged, str(tmp))
    os.replace(tmp, path)
    model = build_policy(setup.config, setup.tokenizer).to(setup.device)
    executor.models["policy"] = LMWorker(model, _optimizer(setup.config, model, setup.config.optimizer.lr))


def add_rl_roles(setup: Setup, executor: LocalExecutor) -> None:
    """The reference (the warm-started policy, frozen; with LoRA the base itself, adapters off) and
    PPO's critic (the warm-started backbone plus a value head; with LoRA the policy's merged
    weights, the critic itself trained in full), for the roles the plan reads."""
    config, roles = setup.config, {node.target for node in setup.rl.source.inputs}
    policy = executor.models["policy"].model
    if "ref" in roles:
        if config.model.lora is not None:
            from rlgraph.backends.lora import reference_of

            executor.models["ref"] = LMWorker(reference_of(policy))
        else:
            executor.models["ref"] = LMWorker(copy.deepcopy(policy).requires_grad_(False))
    if "critic" in roles:
        critic = build_critic(config.model.path, tokenizer=setup.tokenizer, seed=config.train.seed + 1).to(setup.device)
        if config.model.lora is not None:  # the critic trains in full, from the policy's merged weights
            from rlgraph.backends.lora import merged_state_dict

            critic.backbone.load_state_dict(merged_state_dict(policy))
        else:
            critic.backbone.load_state_dict(policy.state_dict())
        lr = config.optimizer.critic_lr or config.optimizer.lr
        executor.models["critic"] = LMWorker(critic, _optimizer(config, critic, lr), kind="critic")


def _optimizer(config: TrainConfig, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """Over the parameters that train (LoRA: the adapters only). AdamW is the fused kernel (one
    call for every tensor; what the memory model assumes) where torch has it for the parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = config.optimizer
    if opt.name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=opt.weight_decay)
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params) or None
    return torch.optim.AdamW(params, lr=lr, betas=opt.betas, weight_decay=opt.weight_decay, fused=fused)


def lr_factor(config: TrainConfig, step: int) -> float:
    """The schedule's multiplier of `optimizer.lr` at RL step `step` (0-based): linear warmup, then
    constant, linear or cosine decay to `min_lr_ratio` at `train.steps` (a time-bound run stays constant)."""
    opt, total = config.optimizer, config.train.steps
    if step < opt.warmup_steps:
        return (step + 1) / (opt.warmup_steps + 1)
    if opt.schedule == "constant" or total is None or total <= opt.warmup_steps:
        return 1.0
    progress = min((step - opt.warmup_steps) / max(total - opt.warmup_steps, 1), 1.0)
    shape = 1.0 - progress if opt.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return opt.min_lr_ratio + (1.0 - opt.min_lr_ratio) * shape


# -- the run --------------------------------------------------------------------------------------
def dry_run(config: TrainConfig, console: Console | None = None) -> Setup:
    """Print the data report, the compiled plan and its memory per rank; build and run nothing."""
    console = console or Console()
    setup = prepare(config)
    for report in setup.reports:
        console.print(report.summary())
    console.print(f"train prompts {len(setup.train_rows)}, eval prompts {len(setup.eval_rows)}")
    console.print(setup.rl.as_text(), markup=False, highlight=False)
    return setup


def train(config: TrainConfig, *, resume: bool = False, console: Console | None = None) -> RunResult:
    """Run `config` in `config.directory`; with `resume`, continue from its latest checkpoint."""
    from rlgraph.train.logging import MetricLogger, make_sinks

    console = console or Console()
    run_dir = config.directory
    checkpoint = latest_checkpoint(run_dir) if resume else None
    if resume and checkpoint is None:
        raise ConfigError(f"--resume {run_dir}: no checkpoint there (no 'latest' file)",
                          fix="start the run without --resume, or point at a run directory that has step-* checkpoints")
    if not resume and latest_checkpoint(run_dir) is not None:
        raise ConfigError(f"run directory {run_dir} already holds checkpoints",
                          fix=f"resume it (rlgraph train --resume {run_dir}), or choose another name/run_dir")
    if checkpoint is not None:
        _refuse_other_run(config, checkpoint)  # before anything is compiled or built
    torch.manual_seed(config.train.seed)
    setup = prepare(config)
    for report in setup.reports:
        console.print(report.summary())
    if checkpoint is not None:
        _refuse_other_data(setup, checkpoint)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config.to_yaml())
    (run_dir / "plan.txt").write_text(setup.rl.as_text() + "\n")
    if checkpoint is None:
        (run_dir / BASE_FILE).unlink(missing_ok=True)  # a fresh run: no base of an earlier attempt here
    executor = build_roles(setup)
    session = _Session(setup, executor, console)
    if checkpoint is None:
        session.warm_start()
        if config.model.lora is not None and config.warm_start.steps:
            rebase_lora(setup, executor)
        session.first_eval = None  # "before" is the policy RL starts from, not the one SFT started from
    add_rl_roles(setup, executor)
    session.reset_optimizer()
    trainer = session.trainer(run_dir)  # the runners (and worker processes, on spmd/ray) start here
    if checkpoint is not None:
        trainer.resume(checkpoint)
        console.print(f"resumed {run_dir} at step {trainer.step} ({checkpoint.name})")
    sinks = make_sinks(run_dir, tensorboard=config.logging.tensorboard, wandb=config.logging.wandb,
                       mlflow=config.logging.mlflow, resume_step=trainer.step if checkpoint else None)
    try:
        with MetricLogger(sinks) as logger:
            session.logger = logger
            if checkpoint is None and setup.eval_rows:
                logger.log(0, session.evaluate())
            seconds = session.loop(trainer)
    finally:
        session.close()
    result = RunResult(run_dir, trainer.step, seconds, session.first_eval, session.last_eval)
    (run_dir / "summary.json").write_text(json.dumps({k: str(v) if isinstance(v, Path) else v
                                                      for k, v in attrs.asdict(result).items()}, indent=1))
    if config.logging.plots:
        from rlgraph.train.plot import plot_run

        plot_run(run_dir)
    return result


def _refuse_other_run(config: TrainConfig, checkpoint: Path) -> None:
    """A checkpoint of another algorithm or model is refused before anything is loaded."""
    from rlgraph.train.checkpoint import read_extra

    saved = read_extra(checkpoint).get("user", {}).get("fingerprint")
    mine = fingerprint(config)
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
    if user.get("lora_base") and not (setup.config.directory / BASE_FILE).is_file():
        raise CheckpointMismatch(f"checkpoint {checkpoint} holds LoRA adapters of a warm-started base, but "
                                 f"{setup.config.directory / BASE_FILE} is gone: they cannot be applied to another base")
    saved = user.get("data")
    mine = data_digest(setup.train_rows)
    if saved is not None and saved != mine:
        raise CheckpointMismatch(
            f"checkpoint {checkpoint} was taken over other training prompts: {saved['prompts']} usable prompts "
            f"(digest {saved['sha256'][:12]}), data.train {setup.config.data.train} now gives {mine['prompts']} "
            f"(digest {mine['sha256'][:12]}); the data position it saved would replay other batches\n"
            "  fix: resume with the data the run started with, or start a new run (model.path can point at an export)")


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
            "hparams": json.dumps(config.algorithm.hparams, sort_keys=True, default=str),
            "rollout": json.dumps(config.rollout.model_dump(), sort_keys=True),
            "model": str(config.model.path), "lora": json.dumps(config.model.lora.model_dump() if config.model.lora else None)}


class _Session:
    """One run's moving parts: runners, samplers, evaluation and per-step metrics."""

    def __init__(self, setup: Setup, executor: LocalExecutor, console: Console):
        self.setup, self.config, self.executor, self.console = setup, setup.config, executor, console
        self.sampler = Sampler(setup.train_rows, setup.config.rollout.prompts_per_step, seed=setup.config.train.seed)
        self.data_digest = data_digest(setup.train_rows)  # saved with each checkpoint: a resume needs the same prompts
        self.runner: PlanRunner | None = None
        self.eval_runner: PlanRunner | None = None
        self.transport: Any = None
        self.logger: Any = None
        self.first_eval: float | None = None
        self.last_eval: float | None = None
        self._stage_seconds: dict[str, float] = {}

    def next_batch(self) -> Any:
        return to_prompts(self.sampler.next_batch(), self.setup.tokenizer)

    def trainer(self, run_dir: Path) -> Trainer:
        """The RL and eval plan runners over this process (local) or worker processes (spmd, ray)."""
        runtime = self.config.runtime
        if runtime.runtime == "local":
            self.runner = PlanRunner(self.setup.rl, self.executor)
            self.eval_runner = PlanRunner(self.setup.eval, self.executor)
        else:
            from rlgraph.backends.world import WorldSpec

            world = WorldSpec.of_executor(self.executor, {"reward": self.setup.rewards}, source=self.config.model.path,
                                          tokenizer=self.config.model.tokenizer, seed=self.config.train.seed,
                                          max_new_tokens=self.config.rollout.max_new_tokens,
                                          weights_dir=run_dir / "start_weights")  # files, not pickled tensors
            self.console.print(f"starting {runtime.nproc} {runtime.runtime} workers ({self.setup.device}) ...")
            if runtime.runtime == "ray":
                from rlgraph.runtime.ray_transport import RayTransport

                self.transport = RayTransport(self.setup.rl.plan, world, address=runtime.address, device=self.setup.device,
                                              timeout_s=runtime.timeout_s)
            else:
                from rlgraph.runtime.spmd import SpmdTransport

                self.transport = SpmdTransport(self.setup.rl.plan, world, device=self.setup.device, timeout_s=runtime.timeout_s)
            controller = world.controller()
            controller.rewards["reward"].fn = self.setup.rewards  # the same pipeline object: its metrics are read here
            self.runner = PlanRunner(self.setup.rl, self.transport, controller=controller)
            self.eval_runner = PlanRunner(self.setup.eval, self.executor)
        checkpoint = self.config.checkpoint
        return Trainer(self.setup.rl.program, self.runner, self.next_batch, self.sampler, run_dir=run_dir,
                       checkpoint_every=checkpoint.every, keep_last=checkpoint.keep_last,
                       before_step=self.before_step, after_step=self.after_step,
                       extra_state=lambda: {"fingerprint": fingerprint(self.config),
                                            "data": self.data_digest, "config": self.config.to_yaml(),
                                            "lora_base": (run_dir / BASE_FILE).is_file()})

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # -- warm start ---------------------------------------------------------------------------
    def warm_start(self) -> None:
        """SFT on the answers until `warm_start.steps` or the target held-out accuracy."""
        warm = self.config.warm_start
        if not warm.steps:
            return
        worker = self.executor.models["policy"]
        worker.optimizer = _optimizer(self.config, worker.model, warm.lr)
        rows = [row for row in self.setup.train_rows if row.answer is not None]
        sampler = Sampler(rows, min(warm.batch_size, len(rows)), seed=self.config.train.seed + 1)
        interpreter, program = Interpreter(self.executor), sft.trace()
        local = PlanRunner(self.setup.eval, self.executor)
        start, accuracy = time.perf_counter(), None
        for step in range(1, warm.steps + 1):
            interpreter.run(program, to_demonstrations(sampler.next_batch(), self.setup.tokenizer))
            if warm.target_accuracy and self.setup.eval_rows and step % warm.eval_every == 0:
                accuracy = self.evaluate(local)["eval/accuracy"]
                if accuracy >= warm.target_accuracy:
                    break
        shown = f", held-out accuracy {accuracy:.1%}" if accuracy is not None else ""
        self.console.print(f"warm start: {step} SFT steps in {time.perf_counter() - start:.1f} s{shown}")

    def reset_optimizer(self) -> None:
        """RL starts a fresh optimizer at `optimizer.lr` from the warm-started weights."""
        worker = self.executor.models["policy"]
        worker.optimizer = _optimizer(self.config, worker.model, self.config.optimizer.lr)

    # -- steps --------------------------------------------------------------------------------
    def before_step(self, step: int) -> None:
        factor = lr_factor(self.config, step)
        for role, base in (("policy", self.config.optimizer.lr),
                           ("critic", self.config.optimizer.critic_lr or self.config.optimizer.lr)):
            # On spmd/ray the optimizers that step live in the workers: the schedule goes to them.
            target = self.transport if self.transport is not None else self.executor
            if role in self.executor.models:
                target.set_learning_rate(role, base * factor)
        self.setup.rewards.pop_metrics()  # what an evaluation left behind is not this step's

    def after_step(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """The plan's metrics plus the reward terms, accuracy, throughput, stage times and evaluation."""
        metrics = dict(metrics)
        terms = self.setup.rewards.pop_metrics()
        metrics.update(terms)
        accuracy = terms.get(f"reward/{self.config.accuracy_reward}")
        if accuracy is not None:
            metrics["accuracy"] = accuracy
        metrics["lr"] = self.config.optimizer.lr * lr_factor(self.config, step - 1)
        rows = self.config.rollout.prompts_per_step * self.config.rollout.n * metrics.get("filter/rounds", 1.0)
        seconds = metrics["time/step_s"]
        metrics["samples_per_s"] = rows / seconds
        if "response_length/mean" in metrics:
            metrics["tokens_per_s"] = rows * metrics["response_length/mean"] / seconds
        metrics.update(self._stage_times())
        every = self.config.eval.every
        if self.setup.eval_rows and every and step % every == 0:
            metrics.update(self.evaluate())
        if self.logger is not None:  # before the step's checkpoint: a run killed after it has its metrics
            self.logger.log(step, metrics)
        return metrics

    def _stage_times(self) -> dict[str, float]:
        """Seconds of this step in each kind of plan step (generate, train, reward, ...)."""
        totals: dict[str, float] = {}
        for step in self.setup.rl.plan.steps:
            kind = _step_kind(step)
            totals[kind] = totals.get(kind, 0.0) + self.runner.step_seconds.get(step.index, 0.0)
        out = {f"time/{kind}_s": seconds - self._stage_seconds.get(kind, 0.0) for kind, seconds in totals.items()}
        self._stage_seconds = totals
        return out

    def evaluate(self, runner: Any = None) -> dict[str, float]:
        """Greedy decoding of the held-out prompts through the evaluate plan (in this process, on
        one device): accuracy and reward."""
        runner = runner or self.eval_runner
        if self.transport is not None:  # the trained weights live in the workers: bring the policy's here
            self.executor.models["policy"].model.load_state_dict(self.transport.pull_state("policy"))
        runner.versions.clear()  # the RL plan moved the policy on since: ask for the live version
        self.setup.rewards.pop_metrics()
        prompts = to_prompts(self.setup.eval_rows, self.setup.tokenizer)
        _, metrics = runner.run(prompts)
        terms = self.setup.rewards.pop_metrics()
        accuracy = terms.get(f"reward/{self.config.accuracy_reward}", metrics["accuracy"])
        self.first_eval = accuracy if self.first_eval is None else self.first_eval
        self.last_eval = accuracy
        return {"eval/accuracy": accuracy, "eval/reward": metrics["accuracy"],
                "eval/response_length": metrics["response_tokens"]}

    def loop(self, trainer: Trainer) -> float:
        from rlgraph.train.progress import RunProgress

        train, start = self.config.train, time.perf_counter()
        remaining = None if train.steps is None else max(train.steps - trainer.step, 0)
        with RunProgress(total_steps=train.steps, seconds=train.seconds, console=self.console,
                         enabled=self.config.logging.progress, start_step=trainer.step) as progress:
            for metrics in trainer.run(steps=remaining, seconds=train.seconds) if remaining != 0 else ():
                progress.update(trainer.step, metrics)
        if trainer.step % self.config.checkpoint.every:
            trainer.save()  # the last step is always checkpointed
        if self.setup.eval_rows and (not self.config.eval.every or trainer.step % self.config.eval.every):
            final = self.evaluate()
            self.logger.log(trainer.step, final)
        return time.perf_counter() - start


def _step_kind(step: Any) -> str:
    """A plan step's kind as the plan prints it: a stage's phase (generate, train, infer, reward, math,
    controller), `transfer` for the collectives, `sync_weights`, `offload`."""
    phase = getattr(step, "phase", None)
    if phase is not None:
        return phase
    name = type(step).__name__
    return {"Transfer": "transfer", "SyncWeights": "sync_weights", "Offload": "offload"}.get(name, name.lower())


def load_run_config(run_dir: str | Path, overrides: list[str] = ()) -> TrainConfig:
    """The resolved config a run saved (`RUN_DIR/config.yaml`), with `overrides`."""
    import yaml

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a run directory: it has no config.yaml", fix="pass the directory rlgraph train wrote")
    config = load_config(None, overrides, base=yaml.safe_load(path.read_text()))
    return config.model_copy(update={"run_dir": str(run_dir)})


def load_object(spec: str, where: str) -> Any:
    """`module:name` or `path/file.py:name` -> the object (a user's algorithm)."""
    from rlgraph.cli import import_modules

    module, _, name = spec.rpartition(":")
    try:
        import_modules([module])
    except SystemExit as error:  # the CLI's message names --import; here the config key is what is wrong
        reason = str(error).removeprefix("rlgraph: ").split(": ", 1)[-1]
        raise ConfigError(f"{where} {spec!r}: cannot import {module}: {reason}") from None
    import sys

    key = Path(module).stem if module.endswith(".py") else module
    found = getattr(sys.modules.get(key), name, None)
    if found is None:
        raise ConfigError(f"{where} {spec!r}: {module} has no {name!r}", fix="name a function the module defines")
    return found
