"""A run's roles as one recipe, `TrainConfig -> WorldSpec -> build`, for every runtime.

    world = world_of_config(setup)                              # the roles the RL plan reads
    world = world_of_config(setup, roles=("policy",), lr=2e-3)  # the warm start's policy
    executor = build_local(setup, world)                        # local: every role in this process
    # spmd/Ray: each worker builds its rank's roles from `world` (`WorldSpec.build`); no model here

The roles come from `model.path` (a model directory is read by each rank where it lies, only its
FSDP2 rows; a config or preset is drawn from `train.seed` on every rank alike), or from start
weights: the warm-started policy, which the spmd/Ray workers write to a file they read back and
the local runtime hands over in memory (`add_rl_roles`); with LoRA, RUN_DIR/base.safetensors, the
merged base its fresh adapters sit on (written on every runtime: the checkpoints' adapters apply
to it). The same recipe, seeds and optimizer factory on every runtime, so all start from the same
weights; `rlgraph.testing.tiny_executor` and the service's tenants build through the same `RoleSpec`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rlgraph.backends.local.executor import LocalExecutor, RewardWorker
from rlgraph.backends.world import RoleSpec, WorldSpec
from rlgraph.train.roles import (BASE_FILE, Start, compiles_training, decode_policy, eval_tokens, optimizer_options,
                                 policy_spec)
from rlgraph.train.setup import Setup, tokenizer_source

MODEL_ROLES = ("policy", "ref", "critic")


def rl_roles(setup: Setup) -> tuple[str, ...]:
    """The model roles the RL plan reads, in `MODEL_ROLES` order, then its teachers: the one place
    this is computed."""
    read = {node.target for node in setup.rl.source.inputs}
    teachers = tuple(role for role in setup.config.model.teachers if role in read)  # distill/gkd
    return tuple(role for role in MODEL_ROLES if role in read) + teachers


def world_of_config(setup: Setup, *, start: Start = None, roles: Sequence[str] | None = None,
                    lr: float | None = None) -> WorldSpec:
    """The `WorldSpec` of `roles` (default: those the RL plan reads) for `setup`'s run. `start` is the
    policy's start weights (a warm start's: a file the workers wrote, or the state dict itself); a
    LoRA run whose RUN_DIR/base.safetensors exists starts from that base when none is given. `lr`
    replaces `optimizer.lr` for the policy (the warm start's)."""
    config = setup.config
    seed, lora = config.train.seed, config.model.lora
    policy = policy_spec(config, start=start, lr=lr)
    carried = {key: getattr(policy, key) for key in ("weights", "weights_file") if getattr(policy, key) is not None}
    specs = {}
    for role in roles or rl_roles(setup):
        if role == "policy":
            specs[role] = policy
        elif role == "ref":  # the frozen start of RL; with LoRA the policy itself, adapters off
            specs[role] = (RoleSpec(source=policy.source, base_of="policy") if lora is not None
                           else RoleSpec(source=policy.source, seed=seed, **carried))
        elif role == "critic":  # trained in full from the policy's (merged) start weights, its value head seeded
            specs[role] = RoleSpec(source=policy.source, kind="critic", optimizer=config.optimizer.name,
                                   lr=config.optimizer.critic_lr or config.optimizer.lr, seed=seed + 1,
                                   optimizer_options=optimizer_options(config),
                                   backbone_seed=None if carried else seed, **carried)
        elif role in config.model.teachers:  # frozen, from the teacher's own directory
            from rlgraph.train.teachers import teacher_spec

            specs[role] = teacher_spec(config, role)
        else:
            raise ValueError(f"world_of_config: no recipe for role {role!r}; the roles are {', '.join(MODEL_ROLES)}")
    envs: dict[str, Any] = {"env": setup.env} if setup.env is not None else {}
    return WorldSpec(specs, {"reward": setup.rewards}, tokenizer=tokenizer_source(config),
                     vision_tokens=config.vision is not None,
                     max_new_tokens=config.rollout.max_new_tokens, seed=seed, envs=envs,
                     decode_compile=decode_policy(setup))


def build_local(setup: Setup, world: WorldSpec, given: Mapping[str, torch.nn.Module] | None = None) -> LocalExecutor:
    """The local runtime's executor of `world`'s roles, in this process on the run's device (the
    modules in `given` as they are), with the run's `train.compile` and, on vLLM, the engine the
    plan's sync_weights steps fill from the policy."""
    config = setup.config
    models = world.build_workers(torch.device(setup.device), setup.tokenizer, given)
    rewards = {name: RewardWorker(fn) for name, fn in world.rewards.items()}
    common = dict(max_new_tokens=world.max_new_tokens, seed=world.seed, device=setup.device, envs=world.envs,
                  decode_compile=world.decode_compile, compile_train=compiles_training(config, str(setup.device)))
    if config.runtime.engine == "vllm":  # generation on vLLM; the plan's sync_weights steps fill its copy
        from rlgraph.backends.vllm.local import VLLMLocalExecutor, build_local_engine

        sizes = setup.rl.plan.sizes
        engine = build_local_engine(models["policy"].model, role="policy", tokenizer=setup.tokenizer, seed=world.seed,
                                    max_model_len=sizes["P"] + max(sizes["T"], eval_tokens(config)))
        return VLLMLocalExecutor(models, rewards, setup.tokenizer, engine=engine, **common)
    return LocalExecutor(models, rewards, setup.tokenizer, **common)


def build_roles(setup: Setup, policy: torch.nn.Module | None = None) -> LocalExecutor:
    """The local run's executor over its policy (the recipe's, or the module given: a checkpoint's)
    and the rewards; `add_rl_roles` adds the other roles the RL plan reads."""
    return build_local(setup, world_of_config(setup, roles=("policy",)),
                       given=None if policy is None else {"policy": policy})


def add_rl_roles(setup: Setup, executor: LocalExecutor) -> None:
    """The RL plan's other roles from the recipe, started from the executor's live policy handed over
    in memory (its merged weights with LoRA): the reference a frozen copy of it (with LoRA its own
    module, adapters off), the critic's backbone a trained copy, the teachers from their directories."""
    policy = executor.models["policy"]
    world = world_of_config(setup, start=plain_weights(policy.model))
    workers = world.build_workers(torch.device(setup.device), setup.tokenizer, given={"policy": policy.model})
    executor.models.update({role: worker for role, worker in workers.items() if role != "policy"})


def plain_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s weights as a plain model holds them: a LoRA model's merged (W + B A * scale)."""
    from rlgraph.backends.lora import is_lora, merged_state_dict

    if is_lora(model):
        return merged_state_dict(model)
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def rebase_lora(setup: Setup, executor: LocalExecutor) -> None:
    """After a LoRA warm start: merge the trained adapters into the base, saved once as
    RUN_DIR/base.safetensors (atomically; the checkpoints' adapters apply to it), and start RL from
    fresh adapters on that base, handed over in memory, so the KL reference (the base, adapters off)
    is the warm-started policy, still with no second copy."""
    merged = {name: tensor.to("cpu").contiguous().clone() for name, tensor in plain_weights(executor.models["policy"].model).items()}
    _write_base(setup, merged)
    world = world_of_config(setup, roles=("policy",), start=merged)
    executor.models["policy"] = world.build_workers(torch.device(setup.device), setup.tokenizer)["policy"]


def _write_base(setup: Setup, merged: Mapping[str, torch.Tensor]) -> None:
    """RUN_DIR/base.safetensors, written atomically and recorded with its sha256 (every checkpoint
    records it, every read checks it)."""
    import os

    from safetensors.torch import save_file

    from rlgraph.train.checkpoint import claim_file
    from rlgraph.train.manifest import claim, release
    from rlgraph.train.modes import follow_umask

    path = setup.config.directory / BASE_FILE
    tmp = path.with_name(path.name + ".tmp")
    claim(path.parent, tmp.name)
    save_file(dict(merged), str(tmp))
    follow_umask(tmp)  # safetensors writes 0600: the run directory's one rule (rlgraph.train.modes)
    os.replace(tmp, path)
    release(path.parent, tmp.name)
    claim_file(path.parent, BASE_FILE)

