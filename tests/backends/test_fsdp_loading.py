"""Start-up weights travel as files and an FSDP2 rank reads only its shard (rlgraph/backends/fsdp/loading.py)."""

from __future__ import annotations

import json
import pickle
import traceback
from pathlib import Path

import attrs
import pytest
import torch
from torch.distributed.tensor import DTensor

import rlgraph as rg
from rlgraph.algorithms import ALGORITHMS
from rlgraph.backends.fsdp.loading import WeightSource, fill_shards, missing_names, parameters_on_meta, write_weights
from rlgraph.backends.local.state import LMWorker
from rlgraph.backends.local.executor import LocalExecutor
from rlgraph.backends.local.models import build_causal_lm, load_tokenizer
from rlgraph.backends.protocols import ModelRef
from rlgraph.backends.world import RoleSpec, WorldSpec
from rlgraph.errors import ConfigError
from rlgraph.testing.tiny import tiny_prompts

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"  # tied in the shipped tiny Qwen2 (as in Qwen2.5-0.5B)


def _model(seed: int = 3) -> torch.nn.Module:
    return build_causal_lm(None, tokenizer=load_tokenizer(None), seed=seed)


def test_a_weights_file_stores_tied_tensors_once_and_reads_them_under_both_names(tmp_path):
    model = _model()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    path = write_weights(model.state_dict(), tmp_path / "policy.safetensors")
    assert [p.name for p in tmp_path.iterdir()] == ["policy.safetensors"]  # the temporary name was renamed
    source = WeightSource.of(path)
    assert source.names == set(model.state_dict())
    assert len(source._handles) == len(model.state_dict()) - 1  # the head is an alias of the embedding
    for name, tensor in model.state_dict().items():
        assert torch.equal(source.tensor(name), tensor), name
    assert torch.equal(source.rows(HEAD, 5, 9), model.lm_head.weight[5:9])


def test_a_safetensors_file_read_without_mmap_gives_what_safe_open_gives(tmp_path):
    """`SafetensorsFile` reads each tensor, or rows of it, with a plain read: the same values, dtypes
    and shapes as safetensors' own reader, clamped row ranges included."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from rlgraph.backends.fsdp.loading import SafetensorsFile

    tensors = {"f32": torch.randn(7, 3), "bf16": torch.randn(5, 2).bfloat16(), "scalar": torch.tensor(3.0),
               "empty": torch.zeros(0, 4), "int": torch.arange(6).view(3, 2), "bool": torch.tensor([True, False])}
    save_file(tensors, str(tmp_path / "t.safetensors"), metadata={"key": "value"})
    file = SafetensorsFile(tmp_path / "t.safetensors")
    assert file.metadata() == {"key": "value"} and sorted(file.keys()) == sorted(tensors)
    with safe_open(str(tmp_path / "t.safetensors"), framework="pt") as handle:
        for name in tensors:
            assert torch.equal(file.tensor(name), handle.get_tensor(name)), name
            for start, stop in [(0, 2), (1, 100), (3, 2), (0, 0)] if tensors[name].dim() else []:
                expected = handle.get_slice(name)[start:stop]
                assert file.rows(name, start, stop).dtype == expected.dtype and torch.equal(file.rows(name, start, stop), expected)


@pytest.mark.parametrize("content", [b"", b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!", b"\x02\x00\x00\x00\x00\x00\x00\x00[]"])
def test_a_file_that_is_not_safetensors_is_refused_naming_it(content, tmp_path):
    from rlgraph.backends.fsdp.loading import SafetensorsFile

    (tmp_path / "bad.safetensors").write_bytes(content)
    with pytest.raises(ConfigError, match="bad.safetensors is not a safetensors file"):
        SafetensorsFile(tmp_path / "bad.safetensors")


def test_a_truncated_safetensors_file_is_refused_naming_the_tensor(tmp_path):
    from safetensors.torch import save_file

    from rlgraph.backends.fsdp.loading import SafetensorsFile

    save_file({"w": torch.randn(64, 4)}, str(tmp_path / "t.safetensors"))
    data = (tmp_path / "t.safetensors").read_bytes()
    (tmp_path / "t.safetensors").write_bytes(data[:-100])
    file = SafetensorsFile(tmp_path / "t.safetensors")
    assert file.rows("w", 0, 8).shape == (8, 4)  # the rows still there read
    with pytest.raises(ConfigError, match="ends before the data of tensor 'w'"):
        file.tensor("w")


def test_a_tensor_of_a_dtype_start_up_cannot_read_is_refused_naming_it(tmp_path):
    from safetensors.torch import save_file

    from rlgraph.backends.fsdp.loading import SafetensorsFile

    save_file({"w": torch.zeros(4, 2, dtype=torch.float8_e4m3fn)}, str(tmp_path / "t.safetensors"))
    with pytest.raises(ConfigError, match="tensor 'w' is stored as F8_E4M3, which start-up weights cannot be read in"):
        SafetensorsFile(tmp_path / "t.safetensors").tensor("w")


def test_a_missing_weights_file_names_the_path_and_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="nowhere.safetensors.*does not exist(.|\n)*weights_dir"):
        WeightSource.of(tmp_path / "nowhere.safetensors")


def test_parameters_on_meta_keeps_buffers_real_and_ties_intact():
    reference = _model()
    with parameters_on_meta():
        empty = _model()
    assert all(p.is_meta for p in empty.parameters())
    assert empty.lm_head.weight is empty.model.embed_tokens.weight
    buffers = dict(reference.named_buffers())
    assert buffers and all(not b.is_meta and torch.equal(b, buffers[n]) for n, b in empty.named_buffers())
    torch.nn.Linear(2, 2)  # outside the context parameters are real again
    assert not torch.nn.Linear(2, 2).weight.is_meta


def test_fill_shards_of_an_unsharded_module_loads_every_value(tmp_path):
    model = _model()
    source = WeightSource.of(write_weights(model.state_dict(), tmp_path / "w.safetensors"))
    with parameters_on_meta():
        empty = _model(seed=99)  # another seed: every value must come from the file
    fill_shards(empty, empty, source, torch.device("cpu"))
    assert empty.lm_head.weight is empty.model.embed_tokens.weight
    for name, tensor in model.state_dict().items():
        assert torch.equal(empty.state_dict()[name], tensor), name


def _executor(optimizer: bool = True) -> LocalExecutor:
    tokenizer = load_tokenizer(None)
    policy = _model()
    worker = LMWorker(policy, torch.optim.AdamW(policy.parameters(), lr=1e-3) if optimizer else None)
    return LocalExecutor({"policy": worker, "ref": LMWorker(_model(seed=4).requires_grad_(False))}, {}, tokenizer)


def test_a_world_with_weights_files_pickles_to_far_less_than_one_policy(tmp_path):
    """What the spmd transport sends each worker at start-up is the pickled WorldSpec: with files it
    carries paths (a few kB), not the two roles' weights (>= 2 fp32 copies of the policy)."""
    executor = _executor()
    policy_bytes = sum(t.numel() * t.element_size() for t in executor.models["policy"].model.state_dict().values())
    in_memory = len(pickle.dumps(WorldSpec.of_executor(executor, {})))
    world = WorldSpec.of_executor(executor, {}, weights_dir=tmp_path)
    with_files = len(pickle.dumps(world))
    assert in_memory > 2 * policy_bytes * 0.9  # before: both roles' weights (the tied head pickles once)
    assert with_files < 0.05 * policy_bytes, (with_files, policy_bytes)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy.safetensors", "ref.safetensors"]
    built = world.build_local()  # the local build reads the files whole
    for role in ("policy", "ref"):
        for name, tensor in executor.models[role].model.state_dict().items():
            assert torch.equal(built.models[role].model.state_dict()[name], tensor), (role, name)


def _rank_main(rank: int, port: int, world: WorldSpec, plan, out: str, rollouts, expected) -> None:
    """One of two gloo ranks: build the FSDP2 executor from the weights files, check each shard, and
    run the sharded roles forward (FSDP2's own all-gathers of the filled shards)."""
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        executor = world.build(rank, plan, torch.device("cpu"))
        report = {}
        for role in ("policy", "ref"):
            model = executor.models[role].model.module  # the HF model inside RoleForward
            source = world.roles[role].weight_source()
            assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
            for name, param in model.named_parameters():
                assert isinstance(param, DTensor), name
                full = source.tensor(name)
                rows = torch.chunk(full, 2)[rank] if rank < len(torch.chunk(full, 2)) else full[:0]
                assert torch.equal(param.to_local(), rows), (role, name)  # exactly this rank's rows
                assert torch.equal(param.full_tensor(), full), (role, name)  # and together the whole tensor
            report[role] = sum(p.to_local().numel() for p in model.parameters())
            logprobs = executor.logprobs(ModelRef(role, 0), rollouts)
            # The same fp32 weights and inputs; only the reduction order of the matmuls may differ
            # from the local run: a few ulps of values of size ~10 (fp32 eps 1.2e-7 -> 1e-5).
            torch.testing.assert_close(logprobs, expected[role], rtol=0, atol=1e-5)
        Path(out).write_text(json.dumps(report))
        dist.destroy_process_group()
    except BaseException:
        Path(out).write_text(traceback.format_exc())
        raise


def test_two_fsdp2_ranks_read_exactly_their_rows_from_the_weights_files(tmp_path):
    from rlgraph.runtime.spmd import free_port, worker_context

    executor = _executor()
    world = attrs.evolve(WorldSpec.of_executor(executor, {}, weights_dir=tmp_path / "w"), fsdp_unit_params=0)
    plan = rg.compile(ALGORITHMS["grpo"], mesh="cpu:2", placement=rg.colocated(checkpointing=False),
                      sizes={"B": 2, "P": 8, "T": 4}, n=2, kl=0.1, max_new_tokens=4).plan
    rollouts = executor.generate(ModelRef("policy", 0), tiny_prompts(2), n=2, temperature=0.0, max_new_tokens=4)
    expected = {role: executor.logprobs(ModelRef(role, 0), rollouts) for role in ("policy", "ref")}
    context, port = worker_context(), free_port()
    outs = [str(tmp_path / f"rank{rank}.txt") for rank in range(2)]
    ranks = [context.Process(target=_rank_main, args=(rank, port, world, plan, outs[rank], rollouts, expected))
             for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(240)
    texts = [Path(out).read_text() if Path(out).exists() else "no report" for out in outs]
    assert all(process.exitcode == 0 for process in ranks), texts
    total = {role: sum(p.numel() for p in executor.models[role].model.parameters()) for role in ("policy", "ref")}
    for role in total:  # each rank holds half of every parameter's rows (dim 0 split in two, sizes even)
        assert sum(json.loads(text)[role] for text in texts) == total[role]
        assert all(json.loads(text)[role] <= total[role] // 2 + 1024 for text in texts)


LORA = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ("q_proj", "v_proj")}


@pytest.mark.parametrize("spec", [RoleSpec(kind="critic", optimizer="sgd", seed=1),
                                  RoleSpec(lora=LORA, optimizer="adamw", seed=3)], ids=["critic", "lora"])
def test_critic_and_lora_roles_built_empty_and_filled_equal_their_full_build(spec, tmp_path):
    tokenizer = load_tokenizer(None)
    full = spec.build_module(tokenizer)  # seeded: the value head / the adapters drawn here
    filed = attrs.evolve(spec, weights_file=str(write_weights(full.state_dict(), tmp_path / "role.safetensors")))
    with parameters_on_meta():
        empty = filed.build_module(tokenizer, empty=True)
    source = filed.weight_source()
    assert not missing_names(empty, source)
    fill_shards(empty, empty, source, torch.device("cpu"))
    assert empty.state_dict().keys() == full.state_dict().keys()
    for name, tensor in full.state_dict().items():
        assert torch.equal(empty.state_dict()[name], tensor), name
    trainable = {name for name, p in full.named_parameters() if p.requires_grad}
    assert trainable and trainable == {name for name, p in empty.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("given", ["weights_file", "model_dir"])
def test_a_lora_role_given_only_its_base_is_built_on_meta_with_the_adapters_its_full_build_draws(given, tmp_path):
    """A plain base (a warm start's merged base file, or a model directory): the rank builds the peft
    model on the meta device, draws the adapters as the full build does (seeded: every runtime alike)
    and fills base and adapters from the file and the draw; nothing is materialised before the fill."""
    from rlgraph.backends.fsdp.build import _empty_module
    from rlgraph.backends.fsdp.loading import LoraStartSource

    tokenizer = load_tokenizer(None)
    model = _model()
    if given == "weights_file":
        spec = RoleSpec(lora=LORA, optimizer="adamw", seed=5, weights_file=str(write_weights(model.state_dict(), tmp_path / "b.st")))
    else:
        model.save_pretrained(str(tmp_path / "dir"), safe_serialization=True)
        spec = RoleSpec(source=str(tmp_path / "dir"), lora=LORA, optimizer="adamw", seed=5)
    full = spec.build_module(tokenizer)  # the base read whole, the adapters drawn with seed 5
    empty, source = _empty_module(spec, tokenizer)
    assert isinstance(source, LoraStartSource) and not missing_names(empty, source)
    assert all(p.device.type == "meta" for p in empty.parameters())
    fill_shards(empty, empty, source, torch.device("cpu"))
    assert empty.state_dict().keys() == full.state_dict().keys()
    for name, tensor in full.state_dict().items():
        assert torch.equal(empty.state_dict()[name], tensor), name
    trainable = {name for name, p in full.named_parameters() if p.requires_grad}
    assert trainable == {name for name, p in empty.named_parameters() if p.requires_grad} and len(trainable) == 8
    a = next(name for name in trainable if ".lora_A." in name)
    assert not torch.equal(source.tensor(a), _empty_module(  # another seed, other adapters
        attrs.evolve(spec, seed=6), tokenizer)[1].tensor(a))
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        source.rows("nope", 0, 1)


@pytest.mark.slow
def test_an_spmd_run_removes_its_start_weights_when_it_ends(tmp_path, monkeypatch):
    """`rlgraph train` on spmd: the warm start's workers write the warm-started policy to
    RUN_DIR/start_weights (a file, not pickled tensors), the RL workers read it, and it is removed at
    the end: a resume starts from a checkpoint."""
    from rlgraph.train.config import load_config
    from rlgraph.train.run import train

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    config = load_config(root / "examples/math_grpo/config.yaml", [
        f"run_dir={tmp_path / 'run'}", "runtime.runtime=spmd", "runtime.nproc=2", "train.steps=1",
        "warm_start.steps=1", "eval.every=0", "eval.max_prompts=4", "rollout.prompts_per_step=2", "rollout.n=2",
        "checkpoint.every=1", "logging.progress=false", "logging.plots=false", "logging.tensorboard=false"])
    train(config)
    assert (tmp_path / "run" / "step-000001").is_dir() and not (tmp_path / "run" / "start_weights").exists()
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["warm_start/steps"] == 1.0  # the file was written (by the warm start's workers), then read


# -- the model directory read where it lies; critics that start from the policy ----------------------
@pytest.mark.parametrize("shard_size", [None, "20KB"], ids=["one-file", "shards"])
def test_a_model_directory_is_read_where_it_lies_and_fills_an_empty_build(tmp_path, shard_size):
    """A rank of `rlgraph train` on a model directory reads its rows from the directory's own
    safetensors (one file or a large model's shards; the tied head under both names), and the
    filled module equals what `from_pretrained` builds."""
    from rlgraph.backends.fsdp.build import _empty_module

    model = _model()
    model.save_pretrained(str(tmp_path), **({"max_shard_size": shard_size} if shard_size else {}))
    files = len(list(tmp_path.glob("*.safetensors")))
    assert files == 1 if shard_size is None else files > 1
    source = WeightSource.of_model_dir(tmp_path)
    assert HEAD in source.names and torch.equal(source.tensor(HEAD), source.tensor(EMBED))
    spec = RoleSpec(source=str(tmp_path), optimizer="adamw")
    empty, found = _empty_module(spec, load_tokenizer(None))
    assert found is not None and found.where == str(tmp_path)
    fill_shards(empty, empty, found, torch.device("cpu"))
    loaded = build_causal_lm(str(tmp_path), tokenizer=load_tokenizer(None))
    assert empty.state_dict().keys() == loaded.state_dict().keys()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(empty.state_dict()[name], tensor), name
    assert empty.lm_head.weight is empty.model.embed_tokens.weight


def test_a_model_directory_without_tied_heads_or_weights_is_not_guessed(tmp_path):
    """An untied head missing from the files is not read from the embedding (the build falls back to
    `from_pretrained`, which says what is wrong); a directory with no safetensors gives no source."""
    model = _model()
    model.save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    source = WeightSource.of_model_dir(tmp_path)
    assert HEAD not in source.names and EMBED in source.names
    with parameters_on_meta():
        empty = RoleSpec(source=str(tmp_path)).build_module(load_tokenizer(None), empty=True)
    assert HEAD in missing_names(empty, source)
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text(json.dumps(config))
    assert WeightSource.of_model_dir(tmp_path / "bare") is None
    assert WeightSource.of_model_dir(tmp_path / "nowhere") is None


def test_a_critic_starts_from_the_policys_weights_by_seed_or_by_file(tmp_path):
    from rlgraph.backends.local.critic import Critic

    tokenizer = load_tokenizer(None)
    expected = Critic(_model(seed=0), seed=1)  # the local run: the policy's backbone, the head drawn with seed+1
    by_seed = RoleSpec(kind="critic", seed=1, backbone_seed=0).build_module(tokenizer)
    policy_file = write_weights(_model(seed=0).state_dict(), tmp_path / "policy.safetensors")
    by_file = RoleSpec(kind="critic", seed=1, weights_file=str(policy_file)).build_module(tokenizer)
    plain = RoleSpec(kind="critic", seed=1).build_module(tokenizer)  # its own backbone, drawn with seed 1
    for name, tensor in expected.state_dict().items():
        assert torch.equal(by_seed.state_dict()[name], tensor), name
        assert torch.equal(by_file.state_dict()[name], tensor), name
    assert not torch.equal(plain.state_dict()["backbone." + EMBED], expected.state_dict()["backbone." + EMBED])


@pytest.mark.parametrize("options, message", [
    ({"backbone_seed": 0}, "RoleSpec.backbone_seed is for a critic role, not a 'lm' one"),
    ({"kind": "critic", "backbone_seed": "0"}, "RoleSpec.backbone_seed must be an int seed, got '0'"),
    ({"kind": "critic", "backbone_seed": True}, "RoleSpec.backbone_seed must be an int seed, got True"),
])
def test_a_bad_backbone_seed_is_refused_naming_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        RoleSpec(**options)


def test_the_engine_of_a_trained_role_is_allocated_empty_for_its_first_sync(tmp_path):
    """No second full read of the model at start-up: the plan syncs a trained role's weights into its
    engine before every generate, so the engine is allocated (buffers computed, head still tied)
    without reading any weights; a frozen generator's engine is built with its weights."""
    from rlgraph.backends.fsdp.build import _generation_engine

    model = _model()
    model.save_pretrained(str(tmp_path))
    tokenizer = load_tokenizer(None)
    world = WorldSpec({"policy": RoleSpec(source=str(tmp_path), optimizer="adamw")}, {})
    trained = rg.compile(ALGORITHMS["grpo"], mesh="cpu:2", placement=rg.colocated(), sizes={"B": 2, "P": 8, "T": 4},
                         n=2).plan
    group = next(group for group in trained.groups if group.name == "policy")
    engine = _generation_engine(world, "policy", group, 0, tokenizer, torch.device("cpu"), trained.groups)
    full = build_causal_lm(str(tmp_path), tokenizer=tokenizer)
    assert not any(param.is_meta or param.requires_grad for param in engine.parameters())
    assert engine.lm_head.weight is engine.model.embed_tokens.weight
    assert [name for name, _ in engine.named_parameters()] == [name for name, _ in full.named_parameters()]
    for (name, buffer), (_, want) in zip(engine.named_buffers(), full.named_buffers(), strict=True):
        assert torch.equal(buffer, want), name  # rotary frequencies: computed, not read
    frozen = [attrs.evolve(group, train=None)]  # a generator no plan step syncs keeps its own weights
    built = _generation_engine(world, "policy", group, 0, tokenizer, torch.device("cpu"), frozen)
    assert all(torch.equal(built.state_dict()[name], tensor) for name, tensor in full.state_dict().items())
