"""What a run needs before any weight exists (`prepare` -> `Setup`): the tokenizer, the prompt splits,
the rewards, and the compiled RL and evaluation plans. Everything here is checked, so
`rlgraph train --dry-run` refuses a bad config before a model is built."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import attrs
import torch

from rlgraph.algorithms import evaluate, evaluate_agent
from rlgraph.ir.primitives import primitive_name
from rlgraph.api import compile as compile_algorithm
from rlgraph.backends.local.executor import check_tokenizer
from rlgraph.backends.local.models import load_tokenizer
from rlgraph.data.prompts import encode_texts, load_prompts, split_holdout, to_prompts
from rlgraph.errors import ConfigError, RLGraphError, TraceError
from rlgraph.rewards import RewardPipeline
from rlgraph.runtime.worker_pool import resolve_device
from rlgraph.train.config import TrainConfig
from rlgraph.train.teachers import check_teacher_sources, check_teachers_read, teacher_roles
from rlgraph.train.vision import check_vision, vision_batches, vision_models, vision_tokenizer
from rlgraph.train.user_code import (ROLLOUT_HPARAMS, build_env, build_rewards, import_modules, load_algorithm,
                                     with_resolved_hparams)


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
    env: Any = None         # the env: section's environment recipe (multi-turn algorithms), or None
    warm: Any = None        # Compiled: the warm start's `sft` plan (`warm_plan`: compiled later on local; None: none)
    warm_eval_rows: list | None = None  # warm_start.eval's prompts (its target's dev split); None: eval_rows
    images: Any = None      # a vision run's `VisionBatches` (rows -> batches carrying their images); None: text

    @property
    def target_rows(self) -> list:
        """The prompts the warm start's target accuracy is measured on."""
        return self.eval_rows if self.warm_eval_rows is None else self.warm_eval_rows

    def prompts(self, rows: list) -> Any:
        """A batch of `rows` as `Prompts` (with their images in a vision run)."""
        return to_prompts(rows, self.tokenizer) if self.images is None else self.images.prompts(rows)


# -- setup ----------------------------------------------------------------------------------------
def prepare(config: TrainConfig) -> Setup:
    """Tokenizer, data, rewards and both plans; refuses a bad config before any model is built."""
    import_modules(config.imports, "imports")  # the same rules as every command's --import
    if config.runtime.threads:
        torch.set_num_threads(config.runtime.threads)
    if config.vision is not None:  # what a vision run cannot do yet, before anything else is checked
        check_vision(config)
    _check_model_path(config)
    _check_generation(config)
    _check_hparams(config)  # traced now, before the data loads: a bad value is the first error, not the last
    tokenizer = _tokenizer(config)
    data = config.data
    extra_fields = data.extra_fields
    if config.vision is not None:  # the rows keep their image references; the images are decoded below
        field = config.vision.image_field
        extra_fields = [*extra_fields, *([field] if field not in extra_fields else [])]
    options = dict(prompt_field=data.prompt_field, answer_field=data.answer_field, extra_fields=extra_fields,
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
    warm_eval_rows = None
    if config.warm_start.eval is not None:
        if config.warm_start.target_accuracy is None:
            raise ConfigError(f"warm_start.eval {config.warm_start.eval}: prompts to measure warm_start.target_accuracy "
                              "on, but no target is set", fix="set warm_start.target_accuracy (e.g. 0.3), or drop warm_start.eval")
        warm_eval_rows, warm_report = load_prompts(config.warm_start.eval, tokenizer, **options)
        reports.append(warm_report)
        if not warm_eval_rows:
            raise ConfigError(f"warm_start.eval {config.warm_start.eval}: no usable prompts",
                              fix="point it at a file of held-out prompts with answers (a dev split)")
    if len(train_rows) < config.rollout.prompts_per_step:
        raise ConfigError(f"data.train {data.train}: {len(train_rows)} usable prompts, fewer than "
                          f"rollout.prompts_per_step={config.rollout.prompts_per_step}",
                          fix="add prompts or lower rollout.prompts_per_step")
    images = None
    if config.vision is not None:  # every image of every split decoded and checked now, before step 1
        splits = [(train_rows, data.train), (eval_rows, data.eval or data.train)]
        images = vision_batches(config, tokenizer, splits + ([(warm_eval_rows, config.warm_start.eval)]
                                                            if warm_eval_rows is not None else []))
    rewards = build_rewards(config)
    config = with_resolved_hparams(config)
    device = _device(config)
    prompt_len = max(map(len, encode_texts([row.text for row in train_rows], tokenizer)))
    env = build_env(config)
    check_teacher_sources(config, tokenizer)
    rl = _compile(config, device, prompt_len, rewards.describe())
    _check_env_is_used(config, rl)
    check_teachers_read(config, model_roles(rl.source))
    warm = None
    if config.runtime.runtime != "local":  # the warm start and the evaluations run on the workers
        answered = sum(row.answer is not None for row in train_rows)
        evaluation, warm = _worker_plans(config, rl, len(eval_rows), answered)
        if warm_eval_rows is not None:
            _check_splits(config, evaluation, len(warm_eval_rows), "the warm start's held-out prompts", "warm_start.eval")
    else:
        evaluation = _local_eval_plan(config, rl, len(eval_rows))
    return Setup(config, tokenizer, list(train_rows), list(eval_rows), reports, rewards, rl, evaluation, device, env, warm,
                 warm_eval_rows, images)


def model_roles(program: Any) -> set[str]:
    """The model roles (policy, ref, critic, teachers) a program reads."""
    from rlgraph.ir import specs as S

    return {node.target for node in program.inputs if isinstance(node.meta.get("spec"), S.ModelSpec)}


def _check_hparams(config: TrainConfig) -> None:
    """Trace the algorithm with the config's hyper-parameters (no sizes needed): a value out of range is
    a ConfigError naming the key and the line or `-o` flag that set it, not the library line that checks it."""
    algorithm = load_algorithm(config.algorithm.name, "algorithm.name")
    _check_takes_prompts(algorithm, config.algorithm.name)  # SFT's refusal says more than its missing `n`
    rollout = rollout_hparams(config, algorithm)
    try:
        algorithm.trace(**config.algorithm.hparams, **rollout)
    except TraceError as error:
        name = getattr(error, "hparam", None)
        key = (f"algorithm.hparams.{name}" if name in config.algorithm.hparams else
               f"rollout.{name}" if name in rollout else None)
        if key is None:
            raise
        origin = config._origins.get(key, "the algorithm's default" if name not in config.algorithm.hparams else "")
        raise ConfigError(f"{key}" + (f" ({origin})" if origin else "") + f": {error.summary}",
                          fix=error.fix and error.fix.replace(f"pass {name}", f"set {key}")) from None


def _check_env_is_used(config: TrainConfig, rl: Any) -> None:
    """An env: section goes with an algorithm that calls rg.rollout, and such an algorithm needs one."""
    rolls_out = any(primitive_name(node) == "rollout" for node in rl.program.graph.nodes)
    if rolls_out and config.env is None:
        raise ConfigError(f"algorithm {config.algorithm.name!r} runs multi-turn episodes (rg.rollout) but the config "
                          "has no env: section", fix="add env: {tools: [calculator]} or env: {path: my_env.py:MyEnv}")
    if not rolls_out and config.env is not None:
        raise ConfigError(f"the config has an env: section but algorithm {config.algorithm.name!r} never steps it "
                          "(it calls no rg.rollout)", fix="use algorithm.name: agent_grpo, or remove the env: section")


def _check_generation(config: TrainConfig) -> None:
    """`generation.compile: on` compiles the native engine's decode step (in this process, or in the
    spmd/ray workers that generate): refused with vLLM, which it would not reach. vLLM on CPU runs
    on the local and spmd runtimes (`_check_vllm_ranks`: on spmd, every rank runs one engine)."""
    runtime = config.runtime
    if runtime.engine == "vllm" and runtime.runtime == "ray" and _device(config) == "cpu":
        raise ConfigError("runtime.engine=vllm with runtime.runtime=ray on CPU is not tested: the vLLM engines of "
                          "the workers are tested on spmd (docs/vllm.md)",
                          fix="runtime.runtime: spmd or local, or runtime.engine: native")
    if runtime.engine == "vllm" and runtime.runtime != "local" and config.model.lora:
        raise ConfigError(f"runtime.engine=vllm with model.lora on runtime.runtime={runtime.runtime} is not tested "
                          "(docs/vllm.md)", fix="runtime.engine: native, or a full-parameter policy (no model.lora)")
    if runtime.engine == "vllm" and config.model.lora is not None and config.warm_start.steps > 0:
        raise ConfigError("runtime.engine=vllm with model.lora and a warm start: the warm start's adapters are merged "
                          "into the base before RL (rlgraph/train/roles.py: rebase_lora), and the vLLM engine serves "
                          "the base it started from, so its samples would come from another policy",
                          fix="warm_start.steps: 0 (start from a warm-started model.path), or runtime.engine: native")
    if config.generation.compile != "on":
        return
    if runtime.engine != "native":
        raise ConfigError(f"generation.compile=on with runtime.engine={runtime.engine!r}: it compiles the native "
                          "engine's decode step", fix="runtime.engine: native, or generation.compile: off")


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
        hub = _looks_like_hub_id(path)
        raise ConfigError(f"model.path {path!r} does not exist" + (
            "; it looks like a Hugging Face Hub id, and rlgraph does not download models" if hub else ""),
            fix=(f"download it first (huggingface-cli download {path} --local-dir models/{path.split('/')[-1]}) and "
                 "point model.path at that directory" if hub else
                 "point it at a Hugging Face model directory (config.json and safetensors weights), "
                 "or leave it null for the shipped tiny Qwen2"))
    if source.is_dir() and not (source / "config.json").is_file():
        raise ConfigError(f"model.path {path!r} is a directory without a config.json",
                          fix="point it at a directory written by model.save_pretrained(...)")


def _looks_like_hub_id(path: str) -> bool:
    """`Qwen/Qwen2.5-0.5B`: one `owner/name` pair of plain words, not a relative or absolute path."""
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", str(path)) is not None and not str(path).startswith(".")


def tokenizer_source(config: TrainConfig) -> str | None:
    """The tokenizer directory the run uses: `model.tokenizer`, else the model directory's own, else
    None (the shipped character tokenizer); the workers of spmd/Ray load the same one."""
    source = config.model.tokenizer or config.model.path
    if source is not None and not (Path(source) / "tokenizer.json").is_file():
        if config.model.tokenizer is not None:
            raise ConfigError(f"model.tokenizer {source!r} has no tokenizer.json",
                              fix="point it at a directory written by tokenizer.save_pretrained(...)")
        source = None  # a model directory without a tokenizer: the shipped one
    return None if source is None else str(source)


def _tokenizer(config: TrainConfig) -> Any:
    """The run's tokenizer, refused here (before the data loads) when generation could not use it."""
    source = tokenizer_source(config)
    key = "model.tokenizer" if config.model.tokenizer else "model.path"
    loaded = load_tokenizer(source) if config.vision is None else vision_tokenizer(source)  # + the vision tokens
    return check_tokenizer(loaded, None if source is None else f"the tokenizer of {key} {source!r}")


def _check_takes_prompts(algorithm: Any, name: str) -> None:
    """`rlgraph train` feeds prompts from the data: an algorithm over given rollouts (SFT's
    demonstrations) is refused before anything is built, not at step 1's batch check."""
    import inspect

    positional = [p for p in inspect.signature(algorithm.fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    annotation = positional[1].annotation if len(positional) > 1 else None
    if str(getattr(annotation, "__name__", annotation)).rpartition(".")[2] == "Rollouts":
        raise ConfigError(f"algorithm.name {name!r} trains on given rollouts (its batch is rg.Rollouts), but "
                          "rlgraph train feeds it prompts to generate from",
                          fix="supervised fine-tuning is the run's warm_start section (warm_start.steps, "
                              "warm_start.trace_field for multi-turn traces); name an RL algorithm here")


def rollout_hparams(config: TrainConfig, algorithm: Any) -> dict[str, Any]:
    """The rollout section's values for the keyword arguments `algorithm` takes, by name.

    An algorithm need not take them all (a user's may fix its own temperature): a key it does not
    take is left out, and refused only when the config sets it to something else than the default,
    which the algorithm would silently ignore. `max_new_tokens` is never refused: a generate without
    it gets the executor's default, which is rollout.max_new_tokens."""
    import inspect

    fixed = sorted(set(ROLLOUT_HPARAMS) & set(config.algorithm.hparams))
    if fixed:
        raise ConfigError(f"algorithm.hparams sets {', '.join(fixed)}",
                          fix=f"set them in the rollout section: rollout.{fixed[0]}")
    parameters = inspect.signature(algorithm.fn).parameters  # hyper-parameters are named keywords (the tracer's rule)
    rollout, defaults = config.rollout, type(config.rollout).model_fields
    values = {}
    for key in ROLLOUT_HPARAMS:
        value = getattr(rollout, key)
        if key in parameters:
            values[key] = tuple(value) if isinstance(value, list) else value  # hashable, as a traced hparam must be
        elif key != "max_new_tokens" and value != defaults[key].get_default(call_default_factory=True):
            raise ConfigError(f"rollout.{key}={value!r}, but the algorithm {config.algorithm.name!r} takes no {key!r} "
                              "keyword argument",
                              fix=f"add `{key}=...` to its keyword arguments and pass it to rg.generate, "
                                  f"or leave rollout.{key} at its default")
    return values


def _compile(config: TrainConfig, device: str, prompt_len: int, reward_pool: str) -> Any:
    """The RL plan (the evaluation's and the warm start's follow its mesh, engine and models)."""
    from rlgraph.plan.hardware import detect_device_kind
    from rlgraph.plan.mesh import Mesh, parse_placement

    rollout, runtime = config.rollout, config.runtime
    algorithm = load_algorithm(config.algorithm.name, "algorithm.name")
    _check_takes_prompts(algorithm, config.algorithm.name)
    hparams = {**config.algorithm.hparams, **rollout_hparams(config, algorithm)}
    ranks = runtime.nproc if runtime.runtime != "local" else 1
    mesh = Mesh(detect_device_kind(device), 1, ranks)  # the GPU found, not a constant
    try:
        placement = parse_placement(runtime.placement, "runtime.placement")
    except TypeError as error:  # a value colocated()/split() cannot take, e.g. split:policy=1,tp
        raise ConfigError(f"runtime.placement {runtime.placement!r}: {error}",
                          fix="e.g. colocated:offload=False, colocated:fsdp=2, split:policy=1,rollout=1, or auto") from None
    if runtime.runtime == "local" and str(runtime.placement).startswith("split"):
        raise ConfigError(f"runtime.placement {runtime.placement!r} on runtime.runtime=local: the local runtime runs "
                          "every role in this one process (a mesh of 1 rank), so no role can have ranks of its own",
                          fix="--runtime spmd --nproc 2 (or ray) for a split, or runtime.placement: colocated")
    models = {"policy": config.model.path} if config.model.path else {}
    vision = {}
    if config.vision is not None:  # the plan counts the images: the tower, its image tokens, the pixel budget
        models = vision_models(config)
        vision = {"pixel_budget": config.vision.pixel_budget}
    models.update(config.model.teachers)  # the memory model sizes each teacher from its own config
    lora = {"policy": config.model.lora.model_dump()} if config.model.lora else None
    extra = {"lora": lora} if lora else {}
    if config.model.teachers:
        from rlgraph.ir.entrypoints import DEFAULT_ROLES

        extra["roles"] = {**DEFAULT_ROLES, **teacher_roles(config)}
    sizes = {"B": rollout.prompts_per_step, "P": prompt_len, "T": rollout.max_new_tokens, "n": rollout.n}
    if config.env is not None and config.env.workers is not None:  # env steps in worker processes (docs/agents.md)
        extra.update(env_workers=config.env.workers, env_memory_mb=config.env.memory_mb)
    if rollout.staleness:  # asynchronous RL: the rollout and train lanes (docs/async.md)
        extra.update(staleness=rollout.staleness, staleness_policy=rollout.staleness_policy)
    if config.train.micro_batch_tokens is not None:  # packed sequences (docs/training.md)
        extra.update(micro_batch_tokens=config.train.micro_batch_tokens)
    try:
        rl = compile_algorithm(algorithm, mesh=mesh, placement=placement, engine=runtime.engine,
                               sizes=sizes, models=models, reward_pool=reward_pool, **vision, **extra, **hparams)
    except ConfigError as error:  # name the config key the option came from
        key = next((key for key in ("rollout.staleness", "train.micro_batch_tokens")
                    if error.summary.startswith(key.split(".")[1] + "=")), None)
        if key is None:
            raise
        option = key.split(".")[1]
        raise ConfigError(f"{key.split('.')[0]}.{error.summary}",
                          fix=error.fix and error.fix.replace(f"{option}=", f"{key}=").replace(f"{option} >=", f"{key} >=")
                          ) from None
    if runtime.engine == "vllm" and runtime.runtime != "local":
        _check_vllm_ranks(config, rl.plan)
    if lora and runtime.runtime != "local":
        from rlgraph.backends.fsdp.build import check_views

        try:  # a LoRA policy's reference (its module, adapters off) must share its ranks: refused at compile time
            check_views({"ref": "policy"}, rl.plan)
        except ValueError as error:
            raise ConfigError(f"runtime.placement {runtime.placement!r}: {error}",
                              fix="colocated:offload=False, or a split giving ref the policy's group: "
                                  "split:policy=1,rollout=1,ref=policy") from None
    return rl


def _local_eval_plan(config: TrainConfig, rl: Any, eval_prompts: int) -> Any:
    """The local runtime's evaluation plan: in this process, on one device. On vLLM it generates from
    the engine's copy: its plan opens with the sync_weights step that loads the live policy
    (`trained`), as the workers' evaluation plans do (`_worker_plans`)."""
    from rlgraph.plan.mesh import Mesh, colocated

    options = rl.options
    chosen, eval_hparams, eval_tokens = _eval_algorithm(config)
    vllm = {"trained": ("policy",)} if config.runtime.engine == "vllm" else {}
    return compile_algorithm(chosen, mesh=Mesh(options.mesh.device, 1, 1), placement=colocated(offload=False),
                             engine=config.runtime.engine, models=options.models, reward_pool=options.reward_pool,
                             sizes={**options.sizes, "B": max(eval_prompts, 1), "n": 1, "T": eval_tokens}, **vllm,
                             env_workers=options.env_workers, env_memory_mb=options.env_memory_mb,
                             pixel_budget=options.pixel_budget, **eval_hparams)


def _check_vllm_ranks(config: TrainConfig, plan: Any) -> None:
    """On spmd every rank runs one vLLM engine (`check_vllm_ranks`: vLLM's engine joins the whole
    torch.distributed world): refused before any worker starts, naming runtime.placement."""
    from rlgraph.backends.fsdp.build import check_vllm_ranks

    try:
        check_vllm_ranks(plan)
    except ValueError as error:
        summary = str(error).split("\n  fix: ")[0]
        raise ConfigError(f"runtime.placement {config.runtime.placement!r} with runtime.engine=vllm: {summary}",
                          fix="runtime.placement: colocated:offload=False, or runtime.engine: native") from None


def _eval_algorithm(config: TrainConfig) -> tuple[Any, dict[str, Any], int]:
    """The evaluation's algorithm, its hyper-parameters and its response tokens: greedy decoding
    ended as the rollouts are, or (with an env: section) greedy episodes scored by the environment."""
    rollout = config.rollout
    eval_tokens = config.eval.max_new_tokens or rollout.max_new_tokens
    if config.env is not None:  # multi-turn: greedy episodes with the environment, scored by it
        return evaluate_agent, dict(max_total_tokens=eval_tokens, max_turns=rollout.max_turns,
                                    max_tokens_per_turn=rollout.max_tokens_per_turn,
                                    step_timeout=rollout.step_timeout), eval_tokens
    return evaluate, dict(max_new_tokens=eval_tokens, stop=tuple(rollout.stop)), eval_tokens


def _worker_plans(config: TrainConfig, rl: Any, eval_prompts: int, warm_rows: int) -> tuple[Any, Any]:
    """spmd/ray: (the evaluation plan, the warm start's `sft` plan or None), both on the RL plan's
    mesh and placement, run on the workers through the same plan runner. The evaluation generates
    from the policy the RL plan trains there (`trained=("policy",)`: its plan starts with the
    sync_weights step that loads the live weights into the engine); the controller holds no model."""
    options = rl.options
    chosen, eval_hparams, eval_tokens = _eval_algorithm(config)
    evaluation = compile_algorithm(chosen, mesh=options.mesh, placement=options.placement, engine=options.engine,
                                   models=options.models, reward_pool=options.reward_pool, trained=("policy",),
                                   sizes={**options.sizes, "n": 1, "B": max(eval_prompts, 1), "T": eval_tokens},
                                   **eval_hparams)
    _check_splits(config, evaluation, eval_prompts, "the held-out prompts",
                  "eval.max_prompts (or data.eval_fraction)")
    return evaluation, _warm_plan(config, rl, warm_rows)


def warm_plan(setup: Setup) -> Any:
    """The warm start's `sft` plan (None without a warm start), run by the plan runner on every
    runtime. `prepare` compiles it for spmd/ray, where the batch must split over the ranks before any
    worker starts; on the local runtime (one rank: nothing to check) it is compiled here, once, when
    the warm start runs, so a run without one, or `--dry-run`, compiles nothing more."""
    if setup.warm is None and setup.config.runtime.runtime == "local":
        setup.warm = _warm_plan(setup.config, setup.rl, sum(row.answer is not None for row in setup.train_rows))
    return setup.warm


def _warm_plan(config: TrainConfig, rl: Any, warm_rows: int) -> Any:
    """The `sft` plan on the RL plan's mesh and placement (a batch of `warm_start.batch_size` answered
    prompts), or None when the run has no warm start."""
    from rlgraph.algorithms import sft

    if not (config.warm_start.steps and warm_rows):
        return None
    options, batch = rl.options, min(config.warm_start.batch_size, warm_rows)
    warm = compile_algorithm(sft, mesh=options.mesh, placement=options.placement, engine=options.engine,
                             models=options.models, sizes={**options.sizes, "n": 1, "B": batch,
                                                           "T": config.rollout.max_new_tokens})
    _check_splits(config, warm, batch, "the warm start's SFT batch", "warm_start.batch_size")
    return warm


def _check_splits(config: TrainConfig, compiled: Any, rows: int, what: str, key: str) -> None:
    """`rows` must split evenly over the data-parallel ranks of every group of `compiled` (each rank
    takes whole rows); refused before anything starts, naming the config key to change."""
    ways = compiled.plan.data_parallel
    if rows and rows % ways:
        fit = rows - rows % ways
        raise ConfigError(f"{what}: {rows} rows cannot be split evenly over the {ways} data-parallel ranks of "
                          f"runtime.runtime={config.runtime.runtime} (the workers run them, each taking whole rows)",
                          fix=f"set {key} so that there are {fit or ways} (a multiple of {ways})")
