"""A run's roles as one recipe, `TrainConfig -> WorldSpec`, built from the config alone.

    world = world_of_config(setup)                                  # the roles the RL plan reads
    world = world_of_config(setup, roles=("policy",), lr=2e-3)      # the warm start's policy
    world = world_of_config(setup, start=run_dir / "start_weights/policy.safetensors")

On spmd and Ray the workers build their roles from this recipe and the controller builds no model:
the policy, its reference and the critic come from `model.path` (a model directory is read by each
rank where it lies, only its FSDP2 rows; a config or preset is drawn from `train.seed` on every rank
alike), or from a weights file the workers wrote themselves (`start`: a warm-started policy; with
LoRA, RUN_DIR/base.safetensors, the merged base its fresh adapters sit on). The roles are those
`rlgraph.train.roles` builds on the local runtime, with the same seeds and the same optimizer
factory, so both runtimes start from the same weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlgraph.backends.world import RoleSpec, WorldSpec
from rlgraph.train.roles import BASE_FILE, decode_policy, optimizer_options
from rlgraph.train.setup import Setup, tokenizer_source

MODEL_ROLES = ("policy", "ref", "critic")


def rl_roles(setup: Setup) -> tuple[str, ...]:
    """The model roles the RL plan reads, in `MODEL_ROLES` order."""
    read = {node.target for node in setup.rl.source.inputs}
    teachers = tuple(role for role in setup.config.model.teachers if role in read)  # distill/gkd
    return tuple(role for role in MODEL_ROLES if role in read) + teachers


def world_of_config(setup: Setup, *, start: str | Path | None = None, roles: Sequence[str] | None = None,
                    lr: float | None = None) -> WorldSpec:
    """The `WorldSpec` of `roles` (default: those the RL plan reads) for `setup`'s run. `start` is a
    weights file of the policy (a warm start's); a LoRA run whose RUN_DIR/base.safetensors exists
    starts from that base instead. `lr` replaces `optimizer.lr` for the policy (the warm start's)."""
    config = setup.config
    source, seed, lora = config.model.path, config.train.seed, config.model.lora
    base = config.directory / BASE_FILE
    if lora is not None and base.is_file():
        start = base  # the plain merged base: the policy's adapters are drawn on it (seeded), as `build_policy` does
    weights = None if start is None else str(Path(start).resolve())
    options = optimizer_options(config)
    adapters = None if lora is None else {"r": lora.r, "alpha": lora.alpha, "dropout": lora.dropout,
                                          "target_modules": tuple(lora.target_modules)}
    specs = {}
    for role in roles or rl_roles(setup):
        if role == "policy":
            specs[role] = RoleSpec(source=source, weights_file=weights, optimizer=config.optimizer.name,
                                   lr=config.optimizer.lr if lr is None else lr, seed=seed,
                                   optimizer_options=options, lora=adapters)
        elif role == "ref":  # the frozen start of RL; with LoRA the policy itself, adapters off
            specs[role] = (RoleSpec(source=source, base_of="policy") if lora is not None
                           else RoleSpec(source=source, weights_file=weights, seed=seed))
        elif role == "critic":  # trained in full from the policy's (merged) start weights, its value head seeded
            specs[role] = RoleSpec(source=source, kind="critic", weights_file=weights, optimizer=config.optimizer.name,
                                   lr=config.optimizer.critic_lr or config.optimizer.lr, seed=seed + 1,
                                   optimizer_options=options, backbone_seed=seed if weights is None else None)
        elif role in config.model.teachers:  # frozen, from the teacher's own directory
            from rlgraph.train.teachers import teacher_spec

            specs[role] = teacher_spec(config, role)
        else:
            raise ValueError(f"world_of_config: no recipe for role {role!r}; the roles are {', '.join(MODEL_ROLES)}")
    envs: dict[str, Any] = {"env": setup.env} if setup.env is not None else {}
    return WorldSpec(specs, {"reward": setup.rewards}, tokenizer=tokenizer_source(config),
                     max_new_tokens=config.rollout.max_new_tokens, seed=seed, envs=envs,
                     decode_compile=decode_policy(setup))
