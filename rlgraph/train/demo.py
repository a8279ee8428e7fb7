"""The demo run: a tiny Qwen2 learns two-number addition, SFT warm start then RL, on CPU (or CUDA).

Everything runs through traced algorithms (`sft`, the RL algorithm, `evaluate`) and the
interpreter; this module only wires the roles, the data and the clock. The RL algorithm is any
of `rlgraph.algorithms` (GRPO by default; PPO gets a critic initialised from the warm-started
policy; DAPO refills its batch from the same prompt sampler). Defaults follow the configuration
measured with a hand-written loop in shared/ENV-NOTES.md, so the gap to those figures is
rlgraph's overhead.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import attrs
import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rlgraph.algorithms import ALGORITHMS, evaluate, sft
from rlgraph.backends.local.critic import build_critic
from rlgraph.backends.local.executor import LMWorker, LocalExecutor, RewardWorker
from rlgraph.backends.local.models import build_causal_lm, load_tokenizer
from rlgraph.data import arithmetic
from rlgraph.rewards import exact_match
from rlgraph.api import compile as compile_algorithm
from rlgraph.backends.world import WorldSpec, make_optimizer
from rlgraph.plan.hardware import detect_device_kind
from rlgraph.plan.mesh import Mesh, colocated
from rlgraph.runtime.spmd import SpmdTransport, resolve_device
from rlgraph.runtime.eager import Interpreter
from rlgraph.runtime.plan_runner import PlanRunner
from rlgraph.train.loop import Trainer


# Demo-specific hyper-parameters: answers are <= 4 tokens (3 digits + EOS) of max_new_tokens=5, so
# DAPO's overlong punishment starts at the 5th token (a response that never stopped).
DEMO_HPARAMS: dict[str, dict[str, Any]] = {"dapo": {"overlong_buffer": 1}}
# agent_grpo needs an environment (rg.rollout): `rlgraph train` with an env: section runs it, not the demo
RL_ALGORITHMS = tuple(name for name in ALGORITHMS if name not in ("sft", "evaluate", "agent_grpo"))


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
    run_dir: str | None = "runs/demo"
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
    rl_seconds: float
    dev_after_sft: float
    test_before_rl: float
    test_after_rl: float
    samples_per_second: float     # rollouts generated (DAPO's dropped groups included) per second of RL
    trained_per_second: float     # rollouts the updates trained on per second of RL
    final_reward: float


def build_roles(config: DemoConfig) -> tuple[LocalExecutor, Any]:
    """The policy on `config.device` (`auto`: CUDA when present; `cuda` without a GPU is refused)."""
    device = resolve_device(config.device)
    tokenizer = load_tokenizer()
    model = build_causal_lm(tokenizer=tokenizer, seed=config.seed).to(device)  # built on the CPU: same weights anywhere
    policy = LMWorker(model, make_optimizer("adamw", model.parameters(), config.sft_lr))
    executor = LocalExecutor({"policy": policy}, {"reward": RewardWorker(exact_match)}, tokenizer,
                             max_new_tokens=config.max_new_tokens, seed=config.seed, device=device)
    return executor, tokenizer


def add_reference(executor: LocalExecutor) -> None:
    """The KL reference: a frozen copy of the warm-started policy (KL is 0 when RL starts)."""
    reference = copy.deepcopy(executor.models["policy"].model).requires_grad_(False)
    executor.models["ref"] = LMWorker(reference)


def add_critic(executor: LocalExecutor, config: DemoConfig) -> None:
    """PPO's critic: the warm-started policy's backbone (as verl initialises it) plus a value head."""
    critic = build_critic(tokenizer=executor.tokenizer, seed=config.seed + 1).to(executor.device)
    critic.backbone.load_state_dict(executor.models["policy"].model.state_dict())
    executor.models["critic"] = LMWorker(critic, make_optimizer("adamw", critic.parameters(), config.critic_lr), kind="critic")


def run_demo(config: DemoConfig = DemoConfig(), console: Console | None = None) -> DemoResult:
    if config.algorithm not in RL_ALGORITHMS:
        raise ValueError(f"demo: unknown RL algorithm {config.algorithm!r}; choose one of {', '.join(RL_ALGORITHMS)}")
    fixed = sorted({"n", "temperature", "max_new_tokens"} & set(config.hparams))
    if fixed:
        raise ValueError(f"demo: set {', '.join(fixed)} through DemoConfig (rl_samples, temperature, max_new_tokens), "
                         "not hparams: the demo sizes its batches and figures from them")
    _check_runtime(config)
    console = console or Console()
    torch.manual_seed(config.seed)
    torch.set_num_threads(config.threads)
    executor, tokenizer = build_roles(config)
    interpreter = Interpreter(executor)
    splits = arithmetic.make_splits(seed=config.seed)
    dev, test = arithmetic.to_prompts(splits.dev, tokenizer), arithmetic.to_prompts(splits.test, tokenizer)
    eval_program = evaluate.trace(max_new_tokens=config.max_new_tokens)

    def accuracy(prompts) -> float:
        return interpreter.run(eval_program, prompts)[1]["accuracy"]

    console.print(f"[bold]rlgraph demo[/]: {sum(p.numel() for p in executor.models['policy'].model.parameters()):,}-parameter "
                  f"Qwen2 learns A+B (A, B in [0, 99]); held-out {len(splits.test)} problems, greedy exact match")
    sft_steps, sft_seconds, dev_acc = warm_start(config, interpreter, splits, tokenizer, lambda: accuracy(dev), console)
    before = accuracy(test)
    console.print(f"SFT: {sft_steps} steps in {sft_seconds:.1f} s, dev {dev_acc:.1%}; "
                  f"held-out accuracy before RL: [bold]{before:.1%}[/]")
    rl_trainer, rl_seconds, reward = _reinforce(config, executor, splits, tokenizer, console)
    after = accuracy(test)
    generated = sum(metrics.get("filter/rounds", 1.0) for metrics in rl_trainer.history) * config.rl_prompts * config.rl_samples
    result = DemoResult(
        algorithm=config.algorithm, sft_steps=sft_steps, sft_seconds=sft_seconds, rl_steps=rl_trainer.step,
        rl_seconds=rl_seconds, dev_after_sft=dev_acc, test_before_rl=before, test_after_rl=after,
        samples_per_second=generated / max(rl_seconds, 1e-9),
        trained_per_second=rl_trainer.step * config.rl_prompts * config.rl_samples / max(rl_seconds, 1e-9),
        final_reward=reward,
    )
    _report(console, result, rl_trainer.run_dir)
    return result


def _check_runtime(config: DemoConfig) -> None:
    """Refuse, before the warm start, a runtime that cannot run the RL plan."""
    if config.runtime == "local":
        return
    if config.nproc < 1 or config.rl_prompts % config.nproc:
        raise ValueError(f"demo: --nproc {config.nproc} must divide the {config.rl_prompts} prompts of an RL step "
                         "(each rank generates and trains on an equal share); try --nproc 2 or 4")
    if config.timeout_s is not None and not config.timeout_s > 0:
        raise ValueError(f"demo: --timeout must be a positive number of seconds, got {config.timeout_s}")


def warm_start(config: DemoConfig, interpreter: Interpreter, splits, tokenizer, dev_accuracy, console: Console):
    """SFT until the dev split shows some signal (RL needs some to start from); (steps, seconds, dev acc)."""
    sampler = arithmetic.PromptSampler(splits.train, batch_size=config.sft_batch, seed=config.seed)
    sft_trainer = Trainer(sft.trace(), interpreter, lambda: arithmetic.to_demonstrations(sampler.next_batch(), tokenizer), sampler)
    dev_acc, start = 0.0, time.perf_counter()
    with _progress(console) as progress:
        task = progress.add_task("SFT", total=config.sft_max_steps, info="")
        for metrics in sft_trainer.run(steps=config.sft_max_steps):
            if sft_trainer.step % config.sft_eval_every == 0:
                dev_acc = dev_accuracy()
            progress.update(task, advance=1, info=f"loss {metrics['policy/loss']:.3f}  dev acc {dev_acc:.1%}")
            if dev_acc >= config.sft_target:
                break
    return sft_trainer.step, time.perf_counter() - start, dev_acc


def compile_rl(config: DemoConfig, device: str, ranks: int = 1) -> Any:
    """The demo's RL plan (`config.algorithm` and its hyper-parameters) for a mesh of `ranks` devices
    of kind `device` ("cpu" or "cuda"), colocated, native generation engine."""
    hparams = {**DEMO_HPARAMS.get(config.algorithm, {}), **config.hparams,
               "n": config.rl_samples, "temperature": config.temperature, "max_new_tokens": config.max_new_tokens}
    mesh = Mesh(detect_device_kind(device), 1, ranks)
    placement = colocated(offload=False, checkpointing=False)
    return compile_algorithm(ALGORITHMS[config.algorithm], mesh=mesh, placement=placement,
                             engine="native",  # the engine the workers run (vLLM: issue 13)
                             sizes={"B": config.rl_prompts, "P": 8, "T": config.max_new_tokens}, **hparams)


def _reinforce(config: DemoConfig, executor: LocalExecutor, splits, tokenizer, console: Console):
    """The RL phase through the compiled plan; returns (trainer, seconds, smoothed reward).

    RL starts a fresh AdamW at `rl_lr` from the warm-started weights. Locally the plan is compiled
    for a mesh of one device, the executor's. With `runtime="spmd"` or `"ray"` the same algorithm
    is compiled for a mesh of `nproc` ranks of that kind and runs in worker processes (the policy
    FSDP2-sharded over them); the trained weights come back to `executor` at the end.
    """
    remote = config.runtime != "local"  # spmd or ray: worker processes, one per mesh rank
    device = executor.device.type  # where the models live: the workers use the same kind of device
    # RL runs the compiled plan, not the eager interpreter: the plan is the truth.
    compiled = compile_rl(config, device, ranks=config.nproc if remote else 1)
    roles = {node.target for node in compiled.source.inputs}
    executor.models["policy"].optimizer = make_optimizer("adamw", executor.models["policy"].model.parameters(), config.rl_lr)
    if "critic" in roles:
        add_critic(executor, config)
    if "ref" in roles:
        add_reference(executor)
    rl_sampler = arithmetic.PromptSampler(splits.train, batch_size=config.rl_prompts, seed=config.seed + 1)
    run_dir = Path(config.run_dir) if config.run_dir else None
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "plan.txt").write_text(compiled.as_text() + "\n")
    transport = None
    if remote:
        world = WorldSpec.of_executor(executor, {"reward": exact_match}, max_new_tokens=config.max_new_tokens,
                                      seed=config.seed)
        console.print(f"starting {config.nproc} {config.runtime} workers ({device}) for the plan's ranks ...")
        if config.runtime == "ray":
            from rlgraph.runtime.ray_transport import RayTransport

            transport = RayTransport(compiled.plan, world, address=config.address, device=device, timeout_s=config.timeout_s)
        else:
            transport = SpmdTransport(compiled.plan, world, device=device, timeout_s=config.timeout_s)
        runner = PlanRunner(compiled, transport, controller=world.controller())
    else:
        runner = PlanRunner(compiled, executor)
    rl_trainer = Trainer(compiled.program, runner, lambda: arithmetic.to_prompts(rl_sampler.next_batch(), tokenizer),
                         rl_sampler, run_dir=run_dir)
    reward, start, label = 0.0, time.perf_counter(), config.algorithm.upper()
    try:
        with _progress(console) as progress:
            task = progress.add_task(label, total=config.rl_seconds, info="")
            for metrics in rl_trainer.run(steps=config.rl_max_steps, seconds=config.rl_seconds):
                reward = 0.9 * reward + 0.1 * metrics["reward"] if rl_trainer.step > 1 else metrics["reward"]
                progress.update(task, completed=min(time.perf_counter() - start, config.rl_seconds),
                                info=f"step {rl_trainer.step}  reward {reward:.2f}")
        seconds = time.perf_counter() - start
        if rl_trainer.run_dir is not None:
            rl_trainer.save()  # a resumable checkpoint, whichever runtime ran the plan
        if transport is not None:
            for role, worker in executor.models.items():  # the trained weights, for evaluation on the controller
                if worker.optimizer is not None:
                    worker.model.load_state_dict(transport.pull_state(role))
    finally:
        if transport is not None:
            transport.close()
    return rl_trainer, seconds, reward


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description:>5}"), BarColumn(), TextColumn("{task.fields[info]}"),
                    TimeElapsedColumn(), console=console, transient=False)


def _report(console: Console, result: DemoResult, run_dir: Path | None) -> None:
    label = result.algorithm.upper()
    table = Table(title="held-out accuracy (200 problems, greedy)")
    table.add_column("before RL (after SFT)")
    table.add_column(f"after {label}")
    table.add_row(f"{result.test_before_rl:.1%}", f"{result.test_after_rl:.1%}")
    console.print(table)
    trained = f" ({result.trained_per_second:,.0f} trained on)" if result.trained_per_second != result.samples_per_second else ""
    console.print(f"{label}: {result.rl_steps} steps in {result.rl_seconds:.0f} s, "
                  f"{result.samples_per_second:,.0f} samples/s{trained}")
    if run_dir is not None:
        (run_dir / "summary.json").write_text(json.dumps(attrs.asdict(result), indent=1))
