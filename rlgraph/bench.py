"""`rlgraph bench`: rlgraph's GRPO against TRL's `GRPOTrainer` on one model, data set, reward and setting.

    rlgraph bench --config small --steps 12 --out bench.json      # or: python benchmarks/vs_trl.py ...

rlgraph's side is an `rlgraph train` configuration (`bench_train_config`) opened as a
`rlgraph.train.run.Run` and stepped by the bench: the same wiring as `train()`, not a copy. Both
sides get the same weights (one tiny Qwen2 written to a directory; TRL loads its policy and
reference from it, rlgraph's run its policy and a frozen copy), the same prompts in the same order
(arithmetic "A+B=", 2 a step, written as the run's JSONL data; TRL's dataset is in the order the
run's seeded sampler draws them), the same reward (`rlgraph.rewards.exact_match`) and the same GRPO
setting: 4 samples a prompt at temperature 1, `max_new_tokens` new tokens, a k3 KL penalty of 0.04
against the reference, clip 0.2, AdamW (no weight decay) at a constant learning rate, gradient
norm clipped to 1, fp32, no gradient checkpointing. TRL's `loss_type="bnpo"` divides by the
tokens of the batch, which is rlgraph's `token_mean` here (one process, no accumulation), and
`use_bias_correction_kl=False` keeps TRL's KL term unweighted by the policy ratio, as rlgraph's
(TRL 1.16 weights it by default; on-policy that changes the gradient, not the loss value).

The sides alternate in one process so load on the machine hits both alike: TRL's `train()` runs
with a callback that, every `per_round` of its steps, runs `per_round` steps of each rlgraph side
(time spent there is not counted as TRL's). After `warmup` steps per side, the median seconds a
step give samples/s and the ratio. `decode_baseline` adds rlgraph with one Hugging Face forward
per decoded token (the generator before the lean decode step), for the before/after figure;
`compiled_decode` adds rlgraph with its decode step compiled (`generation.compile=on`), whose
compile is taken out of its step's time and reported apart (`compile_s`), and rlgraph with the
update's forward compiled too (`train.compile=on`; its compile falls in the warm-up steps, whose
excess over the median is reported as part of `compile_s`), never in the medians.

Before training, on one fixed batch (same prompts, completions, old and reference log-probs and
advantages), TRL's own `_compute_loss` and rlgraph's log-probs + `ppo_clip` + `kl_k3` +
`token_mean` give the loss; their difference shows both optimise the same objective.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from datetime import date
from pathlib import Path
from typing import Any

import attrs
import torch

from rlgraph.backends.local.generation import lean_decoding
from rlgraph.backends.local.models import build_causal_lm, load_tokenizer, tiny_config
from rlgraph.batches import Rollouts
from rlgraph.data import arithmetic
from rlgraph.errors import ConfigError
from rlgraph.plan.timing import COMPILE_SECONDS, STEP_SECONDS, seconds_by_kind
from rlgraph.rewards import exact_match
from rlgraph.train.config import TrainConfig


@attrs.frozen
class BenchConfig:
    """One benchmark setting: the model's shape and the GRPO step both sides run."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    max_new_tokens: int
    prompts: int = 2          # prompts a step
    n: int = 4                # samples a prompt
    beta: float = 0.04        # KL coefficient (k3, against the frozen reference)
    lr: float = 1e-5
    temperature: float = 1.0
    seed: int = 0

    @property
    def samples(self) -> int:
        return self.prompts * self.n


CONFIGS = {
    "small": BenchConfig("small", layers=2, hidden=64, intermediate=256, heads=4, kv_heads=2, max_new_tokens=16),
    "large": BenchConfig("large", layers=4, hidden=256, intermediate=1024, heads=4, kv_heads=2, max_new_tokens=64),
}


def write_model(config: BenchConfig, directory: Path) -> Path:
    """The benchmark's policy (seeded Qwen2 of `config`'s shape) and tokenizer saved in `directory`."""
    tokenizer = load_tokenizer()
    fields = {**tiny_config(tokenizer), "num_hidden_layers": config.layers, "hidden_size": config.hidden,
              "intermediate_size": config.intermediate, "num_attention_heads": config.heads,
              "num_key_value_heads": config.kv_heads, "max_position_embeddings": 128}
    model = build_causal_lm(fields, tokenizer=tokenizer, seed=config.seed)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def bench_problems(config: BenchConfig, count: int) -> list[arithmetic.Problem]:
    """`count` prompts (whole steps' worth), the order both sides consume them in."""
    train = arithmetic.make_splits(seed=config.seed).train
    return [train[i % len(train)] for i in range(count)]


def bench_train_config(config: BenchConfig, model_dir: Path, data: Path, run_dir: Path, steps: int, *,
                       decode_compile: str = "off", compile_train: bool = False) -> TrainConfig:
    """The rlgraph side as an `rlgraph train` configuration: GRPO with the bench's KL (`beta`) on the
    model in `model_dir`, the prompts of `data` (JSONL), exact match, AdamW without weight decay at a
    constant `lr` for `steps` steps; no warm start, no evaluation, no checkpoint, metrics.jsonl only."""
    return TrainConfig.model_validate({
        "name": "bench", "run_dir": str(run_dir),
        "algorithm": {"name": "grpo", "hparams": {"kl": config.beta}},
        "model": {"path": str(model_dir)},
        "data": {"train": str(data), "chat_template": False},
        "rewards": [{"name": "exact_match"}],
        "reward_workers": 0,  # a string compare: no worker processes
        "rollout": {"prompts_per_step": config.prompts, "n": config.n, "max_new_tokens": config.max_new_tokens,
                    "temperature": config.temperature},
        "runtime": {"runtime": "local", "device": "cpu", "placement": "colocated:offload=False,checkpointing=False",
                    "engine": "native"},  # threads: the bench sets them for both sides
        "optimizer": {"name": "adamw", "lr": config.lr, "weight_decay": 0.0},
        "generation": {"compile": decode_compile},
        "train": {"steps": steps, "seed": config.seed, "compile": "on" if compile_train else "off"},
        "logging": {"tensorboard": False, "plots": False, "progress": False, "samples": 0},
        "checkpoint": {"every": 10**9},
    })


class RlgraphSide:
    """rlgraph's GRPO as `rlgraph train` runs it: `bench_train_config` opened as a `rlgraph.train.run.Run`
    (the compiled plan on one CPU device, colocated, native generation, a `PlanRunner` over the
    `LocalExecutor`) and stepped by the bench, so the side is the train wiring, not a copy of it.

    `lean` picks the generator's decode step (False: one Hugging Face forward per token). The run's
    sampler draws `problems` (whole steps' worth) in its seeded order, `order()`, which TRL is given.
    """

    def __init__(self, config: BenchConfig, model_dir: Path, problems: Sequence[arithmetic.Problem], *,
                 lean: bool = True, decode_compile: str = "off", compile_train: bool = False) -> None:
        from rich.console import Console

        from rlgraph.train.run import Run

        self.config, self.problems, self.lean, self.compile_train = config, list(problems), lean, compile_train
        self._scratch = tempfile.TemporaryDirectory(prefix="rlgraph-bench-side-")
        scratch = Path(self._scratch.name)
        data = scratch / "prompts.jsonl"
        data.write_text("".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n" for p in self.problems))
        steps = len(self.problems) // config.prompts
        train_config = bench_train_config(config, model_dir, data, scratch / "run", steps,
                                          decode_compile=decode_compile, compile_train=compile_train)
        self.run = Run(train_config, console=Console(quiet=True))
        self.executor, self.tokenizer = self.run.executor, self.run.setup.tokenizer
        self.runner = self.run.session.runner
        self.seconds: list[float] = []
        self._stages_at_warmup: dict[str, float] = {}

    def order(self) -> list[arithmetic.Problem]:
        """`problems` in the order the run's sampler draws them (a copy of it: the run's is untouched)."""
        sampler, by_prompt = copy.deepcopy(self.run.session.sampler), {p.prompt: p for p in self.problems}
        return [by_prompt[row.text] for _ in range(len(self.problems) // self.config.prompts)
                for row in sampler.next_batch()]

    def step(self) -> dict[str, float]:
        """One GRPO step: the run's `step()` (prompt encoding included in its time, as TRL's step
        encodes its prompts); a decode compile (the first step of a shape) is reported apart
        (`compile_s`), not as step time."""
        with lean_decoding(self.lean):
            metrics = self.run.step()
        self.seconds.append(metrics[STEP_SECONDS] - metrics[COMPILE_SECONDS])
        return metrics

    def close(self) -> None:
        self.run.close()
        self._scratch.cleanup()

    def mark_warm(self) -> None:
        """Stage times from here on are the measured ones."""
        self._stages_at_warmup = self.stage_totals()

    def stage_totals(self) -> dict[str, float]:
        """Seconds so far in each kind of plan step (`rlgraph.plan.timing`: the names `rlgraph train` logs)."""
        return seconds_by_kind(self.runner.compiled.plan.steps, self.runner.step_seconds)

    def stages_per_step(self, measured: int) -> dict[str, float]:
        """Mean seconds a measured step spends in each kind of plan step (generate, train, ...)."""
        totals = self.stage_totals()
        return {kind: (seconds - self._stages_at_warmup.get(kind, 0.0)) / max(measured, 1)
                for kind, seconds in totals.items()}


def trl_available() -> str | None:
    """None when TRL and `datasets` import, else why not (the benchmark's TRL side is optional)."""
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError as error:
        return f"{error}; install the bench extra (pip install 'rlgraph[bench]') for TRL"
    return None


def make_trl_trainer(config: BenchConfig, model_dir: Path, problems: Sequence[arithmetic.Problem], *,
                     max_steps: int, output_dir: Path, callbacks: Sequence[Any] = ()) -> Any:
    """TRL's `GRPOTrainer` on the CPU with the benchmark's setting (see the module docstring)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    dataset = Dataset.from_dict({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TRL passes names transformers deprecated
        args = GRPOConfig(
            output_dir=str(output_dir), use_cpu=True, report_to="none", save_strategy="no", logging_strategy="no",
            disable_tqdm=True, log_completions=False, seed=config.seed, max_steps=max_steps,
            per_device_train_batch_size=config.samples, num_generations=config.n, shuffle_dataset=False,
            max_completion_length=config.max_new_tokens, temperature=config.temperature, beta=config.beta,
            loss_type="bnpo", epsilon=0.2, learning_rate=config.lr, lr_scheduler_type="constant", weight_decay=0.0,
            max_grad_norm=1.0, bf16=False, gradient_checkpointing=False, dataloader_num_workers=0,
            use_bias_correction_kl=False,  # TRL's default weights the KL term by the ratio (on-policy: its gradient)
            optim="adamw_torch_fused",     # the same fused AdamW kernel as rlgraph's side
        )
        trainer = GRPOTrainer(model=str(model_dir), reward_funcs=exact_match, args=args, train_dataset=dataset,
                              processing_class=load_tokenizer(model_dir), callbacks=list(callbacks))
    trainer.generate_seconds = []  # TRL's generation time per step, for the breakdown
    generate = trainer._generate

    def timed_generate(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            trainer.generate_seconds.append(time.perf_counter() - start)

    trainer._generate = timed_generate
    return trainer


# -- the loss on one fixed batch ----------------------------------------------------------------------

@attrs.frozen
class LossCheck:
    """Both sides' GRPO loss on one fixed batch, and how far apart they are."""

    trl: float
    rlgraph: float

    @property
    def difference(self) -> float:
        return abs(self.trl - self.rlgraph)


def fixed_batch(config: BenchConfig, side: RlgraphSide, *, seed: int = 1) -> tuple[Rollouts, dict[str, torch.Tensor]]:
    """(rollouts, {old, ref, advantages}): `config.prompts` prompts from the shortest to the longest
    of the benchmark's (so some are left-padded), random completions of random lengths (EOS-ended or cut), old and reference log-probs
    0.3 and 0.5 (standard normal scale) away from the policy's, so the ratio is clipped on some
    tokens and the KL term is not small."""
    generator = torch.Generator().manual_seed(seed)
    by_length = sorted(side.problems, key=lambda problem: len(problem.prompt))
    spread = [by_length[i * (len(by_length) - 1) // max(config.prompts - 1, 1)] for i in range(config.prompts)]
    prompts = arithmetic.to_prompts(spread, side.tokenizer)
    rows, steps, tok = config.samples, config.max_new_tokens, side.tokenizer
    lengths = torch.randint(1, steps + 1, (rows,), generator=generator)  # [N]
    mask = torch.arange(steps)[None] < lengths[:, None]  # [N, T]
    response = torch.randint(4, len(tok), (rows, steps), generator=generator).masked_fill(~mask, tok.pad_token_id)  # [N, T]
    ended = lengths < steps  # [N] rows that stopped on EOS; the others were cut at max_new_tokens
    response[ended.nonzero().flatten(), lengths[ended] - 1] = tok.eos_token_id
    group = torch.arange(config.prompts).repeat_interleave(config.n)  # [N]
    rollouts = Rollouts(prompts.ids[group], prompts.mask[group], response, mask, torch.zeros(rows, steps), group, {})
    lp = side.executor.logprobs(side.executor.current("policy"), rollouts)  # [N, T]
    noise = torch.randn(2, rows, steps, generator=generator)  # [2, N, T]
    return rollouts, {"old": torch.where(mask, lp + 0.3 * noise[0], 0.0),  # [N, T]
                      "ref": torch.where(mask, lp + 0.5 * noise[1], 0.0),  # [N, T]
                      "advantages": torch.randn(rows, generator=generator)}  # [N]


def loss_check(config: BenchConfig, trainer: Any, side: RlgraphSide) -> LossCheck:
    """TRL's `GRPOTrainer._compute_loss` (its own log-prob forward and loss) against rlgraph's
    log-probs and `ppo_clip + beta * token_mean(kl_k3)` on `fixed_batch`, before either trains."""
    from rlgraph import functional as F

    rollouts, given = fixed_batch(config, side)
    lp = side.executor.logprobs(side.executor.current("policy"), rollouts)  # [N, T]
    surrogate = F.ppo_clip(lp, given["old"], given["advantages"][:, None], rollouts.mask, clip_low=0.2)[0]
    ours = surrogate + config.beta * F.token_mean(F.kl_k3(lp, given["ref"]), rollouts.mask)
    inputs = {"prompt_ids": rollouts.prompt_ids, "prompt_mask": rollouts.prompt_mask.long(),
              "completion_ids": rollouts.response_ids, "completion_mask": rollouts.mask.long(),
              "advantages": given["advantages"], "old_per_token_logps": given["old"],
              "ref_per_token_logps": given["ref"], "num_items_in_batch": rollouts.mask.sum()}
    with torch.no_grad():
        theirs = trainer._compute_loss(trainer.model, inputs)
    return LossCheck(trl=float(theirs), rlgraph=float(ours))


# -- alternation and the report -----------------------------------------------------------------------

@attrs.frozen
class Schedule:
    """`warmup` unmeasured steps per side, then rounds of `per_round` steps per side until each
    side has `steps` measured steps (rounded up to whole rounds)."""

    steps: int = 12
    per_round: int = 3
    warmup: int = 2

    @property
    def measured(self) -> int:
        return -(-self.steps // self.per_round) * self.per_round

    @property
    def total(self) -> int:
        return self.warmup + self.measured

    def boundary(self, done: int) -> bool:
        """Whether the rlgraph sides catch up after the leading side's `done`-th step."""
        return done == self.warmup or (done > self.warmup and (done - self.warmup) % self.per_round == 0)


def check_options(steps: int, per_round: int, warmup: int, threads: int) -> Schedule:
    for flag, value, low in (("--steps", steps, 1), ("--per-round", per_round, 1), ("--warmup", warmup, 0),
                             ("--threads", threads, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(f"rlgraph bench: {flag} must be an integer >= {low}, got {value!r}",
                              fix=f"e.g. {flag} {max(low, 2)}")
    return Schedule(steps=steps, per_round=per_round, warmup=warmup)


def _catch_up(sides: dict[str, RlgraphSide], done: int, schedule: Schedule) -> None:
    """Run each rlgraph side up to `done` steps, one side after the other."""
    for side in sides.values():
        while len(side.seconds) < done:
            side.step()
            if len(side.seconds) == schedule.warmup:
                side.mark_warm()


def _alternating_callback(sides: dict[str, RlgraphSide], schedule: Schedule) -> Any:
    """A TRL trainer callback timing each TRL step (end to end, between step ends) and running the
    rlgraph sides at round boundaries, outside TRL's timed steps."""
    from transformers import TrainerCallback

    class Alternate(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.mark: float | None = None

        def on_step_begin(self, args, state, control, **kwargs):
            if self.mark is None:
                self.mark = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self.mark)
            if schedule.boundary(state.global_step):
                _catch_up(sides, state.global_step, schedule)
            self.mark = time.perf_counter()

    return Alternate()


def _summary(seconds: Sequence[float], config: BenchConfig, warmup: int) -> dict[str, Any]:
    measured = list(seconds[warmup:])
    median = statistics.median(measured)
    return {"median_s_per_step": median, "samples_per_s": config.samples / median,
            "steps_measured": len(measured), "step_seconds": [round(s, 5) for s in seconds]}


def run_bench(config: BenchConfig, schedule: Schedule = Schedule(), *, threads: int = 1, trl: bool = True,
              decode_baseline: bool = True, compiled_decode: bool = True, log: Callable[[str], None] = print
              ) -> dict[str, Any]:
    """Run the benchmark; returns the report `main` writes as JSON (figures per side, ratios, loss check)."""
    if trl and (why := trl_available()) is not None:
        raise ConfigError(f"rlgraph bench: TRL is not importable ({why})", fix="pass --no-trl to time rlgraph alone")
    torch.set_num_threads(threads)
    torch.manual_seed(config.seed)
    report: dict[str, Any] = {"config": attrs.asdict(config), "schedule": attrs.asdict(schedule), **_machine(threads)}
    with tempfile.TemporaryDirectory(prefix="rlgraph-bench-") as tmp:
        model_dir = write_model(config, Path(tmp) / "model")
        problems = bench_problems(config, schedule.total * config.prompts)
        sides = {"rlgraph": RlgraphSide(config, model_dir, problems, lean=True)}
        if compiled_decode:
            sides["rlgraph_compiled_decode"] = RlgraphSide(config, model_dir, problems, decode_compile="on")
            sides["rlgraph_compiled"] = RlgraphSide(config, model_dir, problems, decode_compile="on", compile_train=True)
        if decode_baseline:
            sides["rlgraph_hf_decode"] = RlgraphSide(config, model_dir, problems, lean=False)
        report["parameters"] = sum(p.numel() for p in sides["rlgraph"].executor.models["policy"].model.parameters())
        log(f"rlgraph bench {config.name}: {report['parameters']:,}-parameter Qwen2, {config.prompts} prompts x "
            f"{config.n} samples x {config.max_new_tokens} tokens a step; {schedule.warmup} warm-up + "
            f"{schedule.measured} measured steps per side in rounds of {schedule.per_round}, {threads} thread(s)")
        try:
            results = _run_sides(config, schedule, sides, model_dir, Path(tmp), report, trl=trl, log=log)
        finally:
            for side in sides.values():
                side.close()
    report["results"] = results
    report["load_after"] = os.getloadavg()[0]
    if "trl" in results:
        report["ratio"] = {name: results["trl"]["median_s_per_step"] / results[name]["median_s_per_step"]
                           for name in sides}
    log(format_table(report))
    return report


def _run_sides(config: BenchConfig, schedule: Schedule, sides: dict[str, RlgraphSide], model_dir: Path, tmp: Path,
               report: dict[str, Any], *, trl: bool, log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """The sides stepped as `schedule` alternates them (TRL leading, given the prompts in the rlgraph
    runs' order, after the loss check); each side's figures."""
    results: dict[str, dict[str, Any]] = {}
    if trl:
        callback = _alternating_callback(sides, schedule)
        trainer = make_trl_trainer(config, model_dir, sides["rlgraph"].order(), max_steps=schedule.total,
                                   output_dir=tmp / "trl", callbacks=[callback])
        check = loss_check(config, trainer, sides["rlgraph"])
        report["loss_check"] = {**attrs.asdict(check), "abs_difference": check.difference}
        log(f"loss on one fixed batch: TRL {check.trl:.8f}, rlgraph {check.rlgraph:.8f}, |diff| {check.difference:.2e}")
        trainer.train()
        results["trl"] = _summary(callback.seconds, config, schedule.warmup)
        results["trl"]["generate_s_per_step"] = statistics.median(trainer.generate_seconds[schedule.warmup:])
    else:
        for done in range(1, schedule.total + 1):
            if schedule.boundary(done):
                _catch_up(sides, done, schedule)
    for name, side in sides.items():
        # a compile happens in a warm-up step (not in the medians) and is reported apart
        summary = _summary(side.seconds, config, schedule.warmup)
        # the training compile is not timed apart by the executor: its warm-up steps' excess over the median
        excess = sum(side.seconds[: schedule.warmup]) - schedule.warmup * summary["median_s_per_step"]
        results[name] = {**summary, "stages_s_per_step": side.stages_per_step(schedule.measured),
                         "compile_s": side.executor.decode_ledger.seconds + (excess if side.compile_train else 0.0),
                         "decode_compile_s": side.executor.decode_ledger.seconds,
                         "compiles": len(side.executor.decode_ledger.compiles)}
    return results


def _machine(threads: int) -> dict[str, Any]:
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import trl

        versions["trl"] = trl.__version__
    except ImportError:
        pass
    return {"date": date.today().isoformat(), "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.system()}",
            "threads": threads, "load_before": os.getloadavg()[0], "versions": versions}


def format_table(report: dict[str, Any]) -> str:
    """The report's figures as a Markdown table."""
    lines = ["| side | s/step (median) | samples/s | generate s/step | rlgraph / TRL samples/s | compile s (apart) |",
             "|---|---|---|---|---|---|"]
    for name, result in report["results"].items():
        generate = result.get("generate_s_per_step", result.get("stages_s_per_step", {}).get("generate"))
        ratio = report.get("ratio", {}).get(name)
        compiled = result.get("compile_s")
        lines.append(f"| {name} | {result['median_s_per_step'] * 1e3:.1f} ms | {result['samples_per_s']:.0f} | "
                     f"{'-' if generate is None else f'{generate * 1e3:.1f} ms'} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}x'} | {f'{compiled:.1f}' if compiled else '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlgraph bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small", help="model and step size")
    parser.add_argument("--steps", type=int, default=12, help="measured steps per side (rounded up to whole rounds)")
    parser.add_argument("--per-round", type=int, default=3, help="steps a side runs before the next side's turn")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps per side first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (both sides)")
    parser.add_argument("--no-trl", action="store_true", help="time rlgraph alone (no TRL, no loss check)")
    parser.add_argument("--no-decode-baseline", action="store_true",
                        help="skip rlgraph with one Hugging Face forward per decoded token")
    parser.add_argument("--no-compiled-decode", action="store_true",
                        help="skip rlgraph with the decode step compiled (generation.compile=on), and with the "
                             "update's forward compiled too (train.compile=on)")
    parser.add_argument("--out", type=Path, help="write the report as JSON here")
    args = parser.parse_args(argv)
    import transformers

    transformers.utils.logging.disable_progress_bar()  # weight-loading bars between the figures
    transformers.logging.set_verbosity_error()
    try:
        schedule = check_options(args.steps, args.per_round, args.warmup, args.threads)
        report = run_bench(CONFIGS[args.config], schedule, threads=args.threads, trl=not args.no_trl,
                           decode_baseline=not args.no_decode_baseline, compiled_decode=not args.no_compiled_decode)
    except ConfigError as error:
        print(f"error: {error}")
        return 2
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0
