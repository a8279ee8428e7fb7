"""Meshes and layouts: the text a plan prints for them."""

import pytest

from rlgraph.errors import ConfigError
from rlgraph.plan.mesh import GenerateLayout, Group, Mesh, TrainLayout, colocated, parse_placement, split


def test_a_generate_layout_prints_its_engine_once_place_has_named_it():
    assert str(GenerateLayout(2, 4, "vllm")) == "vllm tp=2 dp=4"
    assert str(GenerateLayout(1, 2, "native")) == "native tp=1 dp=2"
    assert str(GenerateLayout(2, 4)) == "tp=2 dp=4"  # an explicit layout before `place` names the engine


def test_mesh_text_names_nodes_devices_and_kind():
    assert str(Mesh.parse("4x8:h100")) == "4x8 h100" and str(Mesh.parse("cpu:2")) == "1x2 cpu"


@pytest.mark.parametrize("text", [8, "gpu8", "gpu:x", None, "2x:h100"])
def test_mesh_text_that_does_not_parse_is_a_config_error_with_the_fix(text):
    with pytest.raises(ConfigError, match=r"cannot parse mesh .*\n  fix: write e.g. mesh='gpu:8'"):
        Mesh.parse(text)


@pytest.mark.parametrize("text, message", [("gpu:0", "must be >= 1"), ("h10:8", "did you mean 'h100'"),
                                           ("tpu:8", "unknown device 'tpu'")])
def test_mesh_with_no_ranks_or_an_unknown_device_is_refused(text, message):
    with pytest.raises(ConfigError, match=message):
        Mesh.parse(text)


def test_a_train_layout_prints_cpu_offload_last():
    assert str(TrainLayout(8, 1, True, True)) == "fsdp2 shard=8 ckpt cpu_offload"
    assert str(TrainLayout(8)) == "fsdp2 shard=8 ckpt" and str(TrainLayout(4, 2, False, True)) == "fsdp2 shard=4 replicate=2 cpu_offload"


def test_a_node_holds_the_host_memory_of_its_devices():
    assert Mesh.parse("4x8:h100").host_capacity_bytes == 2048 * (1 << 30)  # 256 GiB per H100, 8 per node
    assert Mesh("h100", 2, 4, host_memory_gib=512).host_capacity_bytes == 2048 * (1 << 30)
    assert Mesh.parse("cpu:2").host_capacity_bytes is None  # its devices are the host
    assert Mesh("b200", memory_gib=180).host_capacity_bytes is None  # unknown: not checked


@pytest.mark.parametrize("host", ["yes", 0, -1.0, True])
def test_host_memory_must_be_a_positive_number_of_gib(host):
    with pytest.raises(ConfigError, match=f"host_memory_gib must be a number of GiB > 0 .*got {host!r}"):
        Mesh("h100", 1, 8, host_memory_gib=host)


def test_parse_placement_reads_every_form():
    assert parse_placement("auto") == "auto"
    assert parse_placement("colocated") == colocated()
    assert parse_placement("colocated:fsdp=8,tp=2,offload=False,cpu_offload=true") == colocated(
        fsdp=8, tp=2, offload=False, cpu_offload=True)
    assert parse_placement("split:policy=4,rollout=4,ref=policy,tp=2") == split(
        {"policy": 4, "rollout": 4, "ref": "policy"}, tp=2)


@pytest.mark.parametrize("text, where, message", [
    ("colocatd", "runtime.placement", "runtime.placement 'colocatd': unknown placement 'colocatd'; did you mean 'colocated'?"),
    ("colocated:tpp=2", "--placement", "--placement 'colocated:tpp=2': unknown option 'tpp'; did you mean 'tp'?"),
    ("colocated:tp", "--placement", "--placement colocated: 'tp' must be written key=value"),
    ("split:policy=[4", "runtime.placement", "runtime.placement split: policy=[4: '[4' is not a value"),
])
def test_parse_placement_names_the_flag_or_key_and_the_forms(text, where, message):
    with pytest.raises(ConfigError, match="fix: ") as error:
        parse_placement(text, where)
    assert message in str(error.value)


def test_a_batch_splits_over_the_most_data_parallel_pieces_of_a_group():
    trains_and_generates = Group("policy", (0, 1, 2, 3), train=TrainLayout(fsdp=2), generate=GenerateLayout(tp=1, dp=4))
    assert trains_and_generates.dp == 2 and trains_and_generates.data_parallel == 4  # generation's replicas
    assert Group("ref", (0, 1), infer_dp=2).data_parallel == 2
    assert Group("rollout", (0, 1, 2, 3), generate=GenerateLayout(tp=2, dp=2)).data_parallel == 2
