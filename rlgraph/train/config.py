"""The `rlgraph train` configuration: one YAML (or Python) file names the whole run.

    algorithm: {name: grpo, hparams: {kl: 0.04}}
    model: {path: null}                 # null: the shipped tiny Qwen2; else a local HF directory
    data: {train: data/train.jsonl, eval: data/test.jsonl, prompt_field: question, answer_field: answer}
    rewards: [{name: math}, {name: format_regex, weight: 0.1, options: {pattern: '\\d+'}}]
    rollout: {prompts_per_step: 8, n: 8, max_new_tokens: 64}
    train: {steps: 200}

The schema is a tree of pydantic models that forbid unknown keys: a misspelt key is refused with
the closest valid key and, for a YAML file, the line it is on. `-o key.sub=value` overrides any
field (the value is read as YAML, `1e-3` a float too: `-o train.steps=10`, `-o 'rewards=[{name: math}]'`).
A Python config file defines `config` (a `TrainConfig` or a plain dict).
"""

from __future__ import annotations

import difflib
import runpy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from rlgraph.errors import ConfigError
from rlgraph.ir.keyvalue import parse_assignment


class Section(BaseModel):
    """A config section: unknown keys are errors, values are checked on construction."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class AlgorithmSection(Section):
    name: str = "grpo"                                # rlgraph list algorithms, or a user's @rg.algorithm ("file.py:fn")
    hparams: dict[str, Any] = Field(default_factory=dict)  # the algorithm's keyword arguments (rlgraph trace NAME)


class LoraSection(Section):
    r: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1)


class ModelSection(Section):
    path: str | None = None                           # a local HF directory (config.json + weights); None: the tiny Qwen2
    tokenizer: str | None = None                      # default: the model directory's, else the shipped character one
    lora: LoraSection | None = None                   # train LoRA adapters only (peft); the KL reference is the base
    teachers: dict[str, str] = Field(default_factory=dict)  # distill/gkd: role -> a frozen teacher's model directory

    @field_validator("teachers")
    @classmethod
    def _teacher_names(cls, teachers: dict[str, str]) -> dict[str, str]:
        from rlgraph.train.teachers import RESERVED

        for role in teachers:
            if not role.isidentifier() or role in RESERVED:
                raise ValueError(f"teacher role {role!r} must be a Python name other than {', '.join(RESERVED)} "
                                 "(the algorithm reads it as state.<role>), e.g. teacher")
        return teachers


class DataSection(Section):
    train: str                                        # JSONL, Parquet, CSV, or a `datasets` save_to_disk directory
    eval: str | None = None                           # the held-out split; else `eval_fraction` of train is held out
    eval_fraction: float = Field(0.0, ge=0, lt=1)
    format: Literal["auto", "jsonl", "json", "parquet", "csv", "hf"] = "auto"
    split: str | None = None                          # the split of a saved DatasetDict
    prompt_field: str = "prompt"                      # a string, or a list of chat messages
    answer_field: str | None = "answer"
    extra_fields: list[str] = Field(default_factory=list)  # passed to the rewards by name
    chat_template: bool | Literal["auto"] = "auto"
    system_prompt: str | None = None
    max_prompt_tokens: int | None = Field(None, ge=1)  # longer prompts are dropped and counted


class RewardSection(Section):
    name: str                                         # rlgraph.rewards name, or "module:function" / "file.py:function"
    weight: float = 1.0
    options: dict[str, Any] = Field(default_factory=dict)


class RolloutSection(Section):
    prompts_per_step: int = Field(8, ge=1)
    n: int = Field(8, ge=1)                           # samples per prompt
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)             # nucleus sampling (1.0: the whole vocabulary)
    stop: list[str] = Field(default_factory=list)     # a response ends after the first of these strings (kept)
    staleness: int = Field(0, strict=True, ge=0)       # asynchronous RL: batches generated up to k versions back (docs/async.md)
    staleness_policy: Literal["wait"] = "wait"        # generation is paced so no batch passes the bound
    max_turns: int = Field(1, ge=1)                   # multi-turn (env:): policy turns per episode
    max_tokens_per_turn: int | None = Field(None, ge=1)  # multi-turn: tokens of one turn (None: what is left)
    step_timeout: float | None = Field(30.0, gt=0)    # multi-turn: seconds one env step may take (null: no limit)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, stop: Any) -> Any:
        if isinstance(stop, str):
            stop = [stop]  # `stop: "\n\n"` means the one string
        if isinstance(stop, list) and any(isinstance(item, str) and not item for item in stop):
            raise ValueError("a stop string is empty, which every response would match at once; "
                             "write the text to stop after, e.g. stop: ['\\n\\n']")
        return stop


class GenerationSection(Section):
    """How the native engine decodes (docs/training.md, "Compiled decoding")."""

    compile: Literal["auto", "on", "off"] = "auto"  # the decode step under torch.compile; auto: when the run repays it


class ToolSection(Section):
    name: str                                         # a built-in tool: calculator, python, search
    options: dict[str, Any] = Field(default_factory=dict)  # its keyword arguments (search: corpus or corpus_file)


class EnvSection(Section):
    """The environment of a multi-turn algorithm (`rg.rollout`, docs/agents.md): a built-in tool
    environment (`tools`), or the user's environment class (`path: file.py:MyEnv`, built with `options`)."""

    tools: list[ToolSection] = Field(default_factory=list)
    format: Literal["hermes", "plain"] = "hermes"     # the tool-call syntax the policy writes
    max_calls: int = Field(4, ge=1)                   # tool calls run per turn
    path: str | None = None                           # "file.py:MyEnv" or "module:MyEnv"
    options: dict[str, Any] = Field(default_factory=dict)
    workers: int | None = Field(None, strict=True, ge=1)  # env steps: null in the generating process, k worker processes
    memory_mb: int = Field(4096, strict=True, ge=1024)     # address space of each env worker process

    @field_validator("tools", mode="before")
    @classmethod
    def _tool_names(cls, tools: Any) -> Any:
        return [{"name": tool} if isinstance(tool, str) else tool for tool in tools] if isinstance(tools, list) else tools

    @model_validator(mode="after")
    def _one_kind(self) -> EnvSection:
        if bool(self.tools) == (self.path is not None):
            raise ValueError("give env.tools (a built-in tool environment) or env.path (your environment class, "
                             "file.py:MyEnv), exactly one of them")
        return self


class VisionSection(Section):
    """A vision-language run (docs/vlm.md): each data row names its images in `image_field`; the policy is
    a Qwen2-VL / Qwen2.5-VL (model.path, or the shipped tiny one when it is null)."""

    image_field: str = "image"                        # a path relative to the data file, a data: URI, or a list
    pixel_budget: int = Field(1024, strict=True, ge=1)  # the most pixels an image may have (width * height)
    train_tower: bool = False                         # train the vision tower too (frozen by default)


class RuntimeSection(Section):
    runtime: Literal["local", "spmd", "ray"] = "local"
    nproc: int = Field(1, ge=1)                       # spmd/ray: worker processes (mesh ranks)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    placement: str = "colocated:offload=False"        # as `rlgraph plan --placement`
    engine: Literal["native", "vllm"] = "native"
    address: str | None = None                        # ray: a running cluster
    timeout_s: float | None = Field(None, gt=0)
    threads: int | None = Field(None, ge=1)           # torch CPU threads (default: torch's)


class OptimizerSection(Section):
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)      # linear/cosine decay to lr * min_lr_ratio at the last step
    critic_lr: float | None = Field(None, gt=0)       # PPO's critic (default: lr)


class WarmStartSection(Section):
    """Supervised steps on the answers before RL: a random-init model needs some reward signal to start from."""

    steps: int = Field(0, ge=0)                       # 0: no warm start
    batch_size: int = Field(64, ge=1)
    lr: float = Field(1e-3, gt=0)
    target_accuracy: float | None = Field(None, gt=0, le=1)  # stop early once held-out greedy accuracy reaches it
    eval: str | None = None                           # the prompts that target is measured on (a dev split; default: data.eval's)
    eval_every: int = Field(10, ge=1)
    trace_field: str | None = None                    # multi-turn: the data field of each row's trace (docs/agents.md)


class PretrainSection(Section):
    """`algorithm: pretrain`: how the raw text of data.train is packed (rlgraph.data.pretrain)."""

    seq_len: int = Field(128, strict=True, ge=1)     # tokens in each pack
    packs_per_step: int = Field(8, strict=True, ge=1)  # packs in each step's batch
    text_field: str = "text"                          # the document's field in .jsonl/.csv/.parquet/datasets rows


class TrainSection(Section):
    steps: int | None = Field(None, ge=1)
    seconds: float | None = Field(None, gt=0)
    seed: int = 0
    # packed sequences: micro-batches of at most this many real tokens, no padding (null: micro-batches of rows)
    micro_batch_tokens: int | None = Field(None, strict=True, ge=1)
    # the update's forward + backward under torch.compile: auto (where it pays: backends/local/train_compile.py), on, off
    compile: Literal["auto", "on", "off"] = "auto"


class EvalSection(Section):
    every: int = Field(0, ge=0)                       # RL steps between evaluations (0: only at the start and the end)
    max_prompts: int | None = Field(None, ge=1)
    max_new_tokens: int | None = Field(None, ge=1)    # default: rollout.max_new_tokens
    accuracy_reward: str | None = None                # the reward term that is "accuracy" (default: the first)


class LoggingSection(Section):
    tensorboard: bool = True
    wandb: dict[str, Any] | None = None               # e.g. {project: my-project}; needs rlgraph[wandb]
    mlflow: dict[str, Any] | None = None              # e.g. {tracking_uri: ..., experiment: ...}; needs rlgraph[mlflow]
    progress: bool = True
    plots: bool = True                                # PNG curves in RUN_DIR/plots at the end
    samples: int = Field(4, ge=0, le=1000)            # completions per step and per evaluation in RUN_DIR/samples.jsonl (0: none)


class CheckpointSection(Section):
    every: int = Field(50, ge=1)
    keep_last: int = Field(3, ge=1)


class TrainConfig(Section):
    _origins: dict[str, str] = PrivateAttr(default_factory=dict)  # dotted key -> "file.yaml:12" or "-o key=value"

    name: str = "run"
    run_dir: str | None = None                        # default: runs/<name>
    overwrite: bool = Field(False, strict=True)        # a fresh run may write into a run_dir holding files rlgraph did not write
    imports: list[str] = Field(default_factory=list)  # modules / .py files that register estimators, losses, rewards
    algorithm: AlgorithmSection = AlgorithmSection()
    model: ModelSection = ModelSection()
    data: DataSection
    rewards: list[RewardSection] = Field(default_factory=list)  # at least one, but for algorithm pretrain
    reward_on_error: Literal["fail", "zero"] = "fail"  # a reward that raises, times out, returns NaN or a wrong shape
    reward_timeout_s: float | None = Field(600.0, gt=0)  # one term's call on one batch; null: no limit (a hung reward hangs the run)
    reward_workers: int | None = Field(None, ge=0)    # reward worker processes; null: min(4, CPUs); 0: in the controller (debugging)
    reward_memory_mb: int = Field(4096, ge=1024)      # RLIMIT_AS of each reward worker (torch alone takes ~700 MiB)
    reward_isolation: Literal["auto", "pidns", "process"] = "auto"  # how workers are kept from the controller (docs/security.md)
    rollout: RolloutSection = RolloutSection()
    generation: GenerationSection = GenerationSection()
    env: EnvSection | None = None                     # multi-turn algorithms (agent_grpo): what rg.rollout steps
    vision: VisionSection | None = None               # images in the prompts: a vision-language policy
    runtime: RuntimeSection = RuntimeSection()
    optimizer: OptimizerSection = OptimizerSection()
    warm_start: WarmStartSection = WarmStartSection()
    pretrain: PretrainSection = PretrainSection()
    train: TrainSection = TrainSection()
    eval: EvalSection = EvalSection()
    logging: LoggingSection = LoggingSection()
    checkpoint: CheckpointSection = CheckpointSection()

    @field_validator("rewards")
    @classmethod
    def _distinct_rewards(cls, rewards: list[RewardSection]) -> list[RewardSection]:
        names = [reward.name for reward in rewards]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"reward {repeated[0]!r} is listed twice; give each reward once (weights add up)")
        return rewards

    @model_validator(mode="after")
    def _stopping_rule(self) -> TrainConfig:
        if self.train.steps is None and self.train.seconds is None:
            raise ValueError("train needs a stopping rule: set train.steps or train.seconds")
        if not self.rewards and self.algorithm.name != "pretrain":
            raise ValueError(f"rewards: algorithm {self.algorithm.name!r} scores its samples, but no reward is listed; "
                             "add one, e.g. rewards: [{name: math}] (only algorithm pretrain trains without)")
        # eval.accuracy_reward is checked with the rewards (run.build_rewards): a reward file that
        # cannot be loaded is the first thing to fix, not a name that refers to it.
        return self

    def __eq__(self, other: object) -> bool:
        """Equal settings are equal configs, wherever they were written (`_origins` is not compared)."""
        if not isinstance(other, TrainConfig):
            return NotImplemented
        return self.__dict__ == other.__dict__

    __hash__ = None  # mutable settings, as pydantic's own models

    @property
    def directory(self) -> Path:
        return Path(self.run_dir if self.run_dir is not None else f"runs/{self.name}")

    @property
    def accuracy_reward(self) -> str:
        return self.eval.accuracy_reward or self.rewards[0].name

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


# -- loading --------------------------------------------------------------------------------------
def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), *,
                base: Mapping[str, Any] | None = None) -> TrainConfig:
    """The config of `path` (YAML or .py), or `base` (a resolved config dict), with `overrides`
    (`key.sub=value`) applied; any mistake is a `ConfigError` naming the key, the file and line."""
    if path is not None:
        raw, lines = _read(Path(path))
    else:
        raw, lines = dict(base or {}), {}
    where = str(path) if path is not None else "the run's saved config"
    overridden = set()
    for item in overrides:
        key, value = _parse_override(item)
        _set(raw, key, value, item)
        overridden.add(key)
    try:
        config = TrainConfig.model_validate(raw)
    except ValidationError as error:
        raise ConfigError(_explain(error, where, lines, overridden),
                          fix="compare with the documented schema in docs/training.md (or rlgraph train --help)") from None
    # where each key was set, for errors found later (a hyper-parameter out of range names its line or -o)
    config._origins = {**{key: f"{where}:{line}" for key, line in lines.items()},
                       **{key: f"-o {item}" for item in overrides for key in [_parse_override(item)[0]]}}
    return config


def _read(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """(the raw dict, dotted key -> line number for YAML)."""
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist", fix="pass the path of a .yaml or .py config")
    if path.suffix == ".py":
        namespace = runpy.run_path(str(path))
        if "config" not in namespace:
            raise ConfigError(f"config file {path} defines no `config`", fix="end the file with `config = {...}` or TrainConfig(...)")
        config = namespace["config"]
        return (config.model_dump() if isinstance(config, TrainConfig) else dict(config)), {}
    if path.suffix not in (".yaml", ".yml"):
        raise ConfigError(f"config file {path}: unknown kind {path.suffix!r}", fix="use a .yaml/.yml or .py file")
    text = path.read_text()
    try:
        raw = yaml.safe_load(text) or {}
        lines = _key_lines(yaml.compose(text))
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {error}", fix="fix the YAML syntax at the line shown") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} holds a {type(raw).__name__}, not a mapping of sections",
                          fix="write sections such as `data:` and `rewards:` at the top level")
    return raw, lines


def _key_lines(node: Any, prefix: str = "") -> dict[str, int]:
    """Each dotted key of a YAML node tree -> its 1-based line (list items as `rewards.0.name`)."""
    found: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            dotted = f"{prefix}{key.value}"
            found[dotted] = key.start_mark.line + 1
            found.update(_key_lines(value, dotted + "."))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            found[f"{prefix}{index}"] = item.start_mark.line + 1
            found.update(_key_lines(item, f"{prefix}{index}."))
    return found


def _parse_override(item: str) -> tuple[str, Any]:
    return parse_assignment(item, "-o", "train.steps=10 or -o optimizer.lr=1e-5")  # the same reading as -p


def _set(raw: dict[str, Any], key: str, value: Any, item: str) -> None:
    node: Any = raw
    parts = key.split(".")
    for part in parts[:-1]:
        if isinstance(node, list):
            node = node[_list_index(part, node, item)]
            continue
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, (dict, list)):
            raise ConfigError(f"override {item!r}: {part!r} holds {child!r}, not a section", fix="override the whole value")
        node = child
    if isinstance(node, list):
        node[_list_index(parts[-1], node, item)] = value
    else:
        node[parts[-1]] = value


def _list_index(part: str, node: list, item: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"override {item!r}: {part!r} is not an index of a list of {len(node)}",
                          fix=f"use an index 0..{len(node) - 1}")
    return int(part)


def _explain(error: ValidationError, where: str, lines: Mapping[str, int], overridden: set[str]) -> str:
    """One line per problem: the dotted key, where it is (file:line or -o), what is wrong, the closest valid key."""
    problems = []
    for item in error.errors():
        loc = [str(part) for part in item["loc"]]
        dotted = ".".join(loc)
        origin = "-o" if dotted in overridden else (f"{where}:{lines[dotted]}" if dotted in lines else where)
        if item["type"] == "extra_forbidden":
            known = _fields_at(loc[:-1])
            close = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.5)
            hint = f"; did you mean {'.'.join([*loc[:-1], close[0]])!r}?" if close else f"; valid keys: {', '.join(known)}"
            problems.append(f"unknown key {dotted!r} ({origin}){hint}")
        elif item["type"] == "missing":
            problems.append(f"missing key {dotted!r} ({origin})")
        else:
            shown = "" if item["type"].startswith("value_error") and not loc else f" (got {item.get('input')!r})"
            message = item["msg"].removeprefix("Value error, ")
            problems.append(f"{dotted or 'config'}: {message}{shown if loc else ''} ({origin})")
    return "the training config is not valid:\n  " + "\n  ".join(problems)


def _fields_at(loc: Sequence[str]) -> list[str]:
    """The valid keys of the section at `loc` (list indices skipped)."""
    model: Any = TrainConfig
    for part in loc:
        if part.isdigit():
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        model = _section_type(field.annotation)
        if model is None:
            return []
    return list(model.model_fields)


def _section_type(annotation: Any) -> type[Section] | None:
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _section_type(arg)
        if found is not None:
            return found
    return None
