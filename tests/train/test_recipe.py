"""`world_of_config`: the spmd/Ray workers' roles from the config alone, equal to the local run's roles."""

from __future__ import annotations

import pickle
import pytest
import torch

from rlgraph.errors import ConfigError
from rlgraph.train.recipe import world_of_config
from rlgraph.train.recipe import add_rl_roles, build_roles
from rlgraph.train.setup import prepare
from tests.train.test_run import make_config

PPO = ["algorithm={name: ppo, hparams: {kl: 0.02}}"]
LORA = ["model.lora={r: 4}"]


def _roles(executor) -> dict[str, dict[str, torch.Tensor]]:
    return {role: worker.model.state_dict() for role, worker in executor.models.items()}


@pytest.mark.parametrize("overrides", [[], PPO, LORA, [*PPO, *LORA]], ids=["grpo-kl", "ppo", "lora", "ppo-lora"])
def test_the_recipe_builds_the_roles_the_local_run_builds(tmp_path, overrides):
    """Policy, reference and critic from the recipe (what each worker builds) equal `build_roles` +
    `add_rl_roles` (the local run's), tensor for tensor, with the same optimizer settings."""
    config, _ = make_config(tmp_path, "run", overrides)
    setup = prepare(config)
    local = build_roles(setup)
    add_rl_roles(setup, local)
    world = world_of_config(setup)
    built = world.build_local()
    assert set(world.roles) == set(local.models)
    for role, state in _roles(local).items():
        got = built.models[role].model.state_dict()
        assert got.keys() == state.keys(), role
        for name, tensor in state.items():
            assert torch.equal(got[name], tensor), (role, name)
        want, have = local.models[role].optimizer, built.models[role].optimizer
        assert (want is None) == (have is None), role
        if want is not None:
            assert type(want) is type(have)
            assert {k: v for k, v in want.defaults.items()} == {k: v for k, v in have.defaults.items()}, role
    if LORA[0] in overrides:
        assert world.roles["ref"].base_of == "policy"  # the base with adapters off, no weights of its own


def test_a_warm_started_start_file_reaches_policy_reference_and_critic_backbone(tmp_path):
    from rlgraph.backends.fsdp.loading import write_weights
    from rlgraph.backends.local.models import build_causal_lm

    config, _ = make_config(tmp_path, "run", PPO)
    setup = prepare(config)
    warm = build_causal_lm(None, tokenizer=setup.tokenizer, seed=7)  # stands for the workers' warm-started policy
    start = write_weights(warm.state_dict(), tmp_path / "start_weights" / "policy.safetensors")
    built = world_of_config(setup, start=start).build_local()
    for name, tensor in warm.state_dict().items():
        assert torch.equal(built.models["policy"].model.state_dict()[name], tensor), name
        assert torch.equal(built.models["ref"].model.state_dict()[name], tensor), name
        assert torch.equal(built.models["critic"].model.backbone.state_dict()[name], tensor), name


def test_what_a_worker_receives_at_start_up_is_far_less_than_one_policy(tmp_path):
    """The spmd transport pickles (plan, WorldSpec) to every worker: paths and settings, not weights
    (before issue 20: both roles' fp32 state dicts, > 2 policies a worker)."""
    config, _ = make_config(tmp_path, "run", ["runtime.runtime=spmd", "runtime.nproc=2"])
    setup = prepare(config)
    policy_bytes = sum(t.numel() * t.element_size() for t in build_roles(setup).models["policy"].model.parameters())
    for start in (None, tmp_path / "start_weights" / "policy.safetensors"):
        sent = len(pickle.dumps((setup.rl.plan, world_of_config(setup, start=start))))
        assert sent < 0.2 * policy_bytes, (sent, policy_bytes)  # the tiny model: 0.5 MB; the plan and rewards ~50 kB


def test_a_role_the_recipe_does_not_know_is_refused(tmp_path):
    config, _ = make_config(tmp_path, "run")
    with pytest.raises(ValueError, match="no recipe for role 'rollout'; the roles are policy, ref, critic"):
        world_of_config(prepare(config), roles=("rollout",))


@pytest.mark.parametrize("override, message", [
    ("eval.max_prompts=7", r"the held-out prompts: 7 rows cannot be split evenly over the 2 data-parallel ranks"
                           r"(.|\n)*fix: set eval.max_prompts \(or data.eval_fraction\) so that there are 6"),
    ("eval.max_prompts=1", r"the held-out prompts: 1 rows cannot(.|\n)*so that there are 2 \(a multiple of 2\)"),
    ("warm_start.batch_size=15", r"the warm start's SFT batch: 15 rows cannot(.|\n)*fix: set warm_start.batch_size "
                                 r"so that there are 14"),
])
def test_rows_the_workers_cannot_split_evenly_are_refused_naming_the_key(tmp_path, override, message):
    config, _ = make_config(tmp_path, "run", ["runtime.runtime=spmd", "runtime.nproc=2", override])
    with pytest.raises(ConfigError, match=message):
        prepare(config)


def test_the_workers_evaluation_plan_loads_the_live_policy_first(tmp_path):
    """On spmd the evaluation is a plan over the RL workers whose first step syncs the trained policy
    into the engine; the warm start is the `sft` plan on the same groups."""
    config, _ = make_config(tmp_path, "run", ["runtime.runtime=spmd", "runtime.nproc=2"])
    setup = prepare(config)
    steps = setup.eval.as_text().split("steps:\n")[1].splitlines()
    assert steps[0].strip().startswith("[0] sync_weights policy@v")
    rl_groups = {group.name: group for group in setup.rl.plan.groups}
    assert all(rl_groups[group.name] == group for group in setup.eval.plan.groups)
    assert setup.warm.plan.algorithm == "sft" and setup.warm.plan.groups[0].ranks == rl_groups["policy"].ranks
    local, _ = make_config(tmp_path, "local")
    assert prepare(local).warm is None  # the local runtime warm-starts in process


@pytest.mark.parametrize("mode", ["on", "off", "auto"])
def test_generation_compile_reaches_the_workers_executors(tmp_path, mode):
    """`generation.compile` travels in the recipe (pickled to every worker) to the executors the
    ranks build, as `build_roles` gives it to the local run's."""
    config, _ = make_config(tmp_path, "run", ["runtime.runtime=spmd", "runtime.nproc=2", f"generation.compile={mode}"])
    setup = prepare(config)
    world = pickle.loads(pickle.dumps(world_of_config(setup)))
    assert world.decode_compile == build_roles(setup).decode_ledger.policy
    assert world.build_local().decode_ledger.policy.mode == mode


def test_auto_decode_projects_the_calls_of_one_ranks_share_of_the_rows(tmp_path):
    """A spmd rank generates B x n / ranks rows (and its share of the eval prompts): `auto` projects
    its calls at those numbers of rows, which are the shapes the rank's decode step sees."""
    from rlgraph.train.roles import decode_policy

    policies = {}
    for runtime, nproc in (("local", 1), ("spmd", 2)):
        config, _ = make_config(tmp_path, runtime, [f"runtime.runtime={runtime}", f"runtime.nproc={nproc}",
                                                    "generation.compile=auto"])
        setup = prepare(config)
        policies[runtime] = (decode_policy(setup).calls, setup.config.rollout, len(setup.eval_rows))
    (local, rollout, evals), (spmd, _, _) = policies["local"], policies["spmd"]
    rows = rollout.prompts_per_step * rollout.n
    assert sorted(local) == sorted({rows, evals}) and sorted(spmd) == sorted({rows // 2, evals // 2})
    assert local[rows] == spmd[rows // 2] and local[evals] == spmd[evals // 2]


@pytest.mark.parametrize("bad", ["yes", 2, None])
def test_a_bad_decode_compile_is_refused_when_the_world_is_built(bad):
    from rlgraph.backends.world import WorldSpec

    with pytest.raises(ConfigError, match=f"WorldSpec.decode_compile={bad!r} is not a decode compile mode"):
        WorldSpec({}, decode_compile=bad)
