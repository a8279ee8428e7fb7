"""Hardware profiles: one table for memory and speed; users add their own."""

import pytest

from rlgraph.plan import hardware as H
from rlgraph.plan.hardware import detect_device_kind, profile, profile_for_gpu
from rlgraph.plan.mesh import DEVICE_MEMORY_GIB, Mesh


def test_every_profile_has_a_source_and_sane_numbers():
    assert {"h100", "h200", "a100", "h20", "l40s", "cpu"} <= set(H.PROFILES)
    for profile in H.PROFILES.values():
        assert profile.source and profile.peak_flops > 0 and profile.memory_bandwidth > 0
        assert profile.intra_node_bandwidth >= profile.inter_node_bandwidth or profile.name == "l40s"
        assert DEVICE_MEMORY_GIB[profile.name] == profile.memory_gib


def test_the_memory_model_reads_the_same_table():
    assert Mesh.parse("2x8:h200").capacity_bytes == 141 * (1 << 30)
    assert Mesh.parse("h20:8").capacity_bytes == 96 * (1 << 30)


def test_a_registered_profile_makes_a_mesh_of_it(monkeypatch):
    monkeypatch.setattr(H, "PROFILES", dict(H.PROFILES))
    monkeypatch.setitem(DEVICE_MEMORY_GIB, "mygpu", 0)  # restored afterwards
    H.register_profile(H.HardwareProfile("mygpu", 1e15, 4e12, 192, 900e9, 100e9, 64e9, "my datasheet"))
    assert Mesh.parse("mygpu:4").capacity_bytes == 192 * (1 << 30)
    assert H.profile("mygpu").peak_flops == 1e15


def test_an_unknown_device_names_the_known_ones():
    with pytest.raises(ValueError, match="register_profile"):
        H.profile("tpu")


# ----------------------------------------------------------------------------- the GPU in hand

GiB = 2**30


@pytest.mark.parametrize("name, memory, want", [
    ("NVIDIA H100 80GB HBM3", 79.6 * GiB, "h100"),   # as the lent H100 reports itself (81,559 MiB)
    ("NVIDIA H200", 139.8 * GiB, "h200"),
    ("NVIDIA A100-SXM4-80GB", 79.2 * GiB, "a100"),
    ("NVIDIA H20", 95.0 * GiB, "h20"),
])
def test_a_gpu_is_named_by_its_profile(name, memory, want):
    assert profile_for_gpu(name, int(memory)) == want


def test_a_known_gpu_with_other_memory_gets_a_profile_with_its_memory():
    assert profile_for_gpu("NVIDIA L40S", int(44.4 * GiB)) == "l40s_44g"  # the table's 48 is GB, not GiB
    kind = profile_for_gpu("NVIDIA A100-SXM4-40GB", int(39.4 * GiB))
    assert kind == "a100_39g"
    assert profile(kind).memory_gib == 39.4 and profile(kind).peak_flops == profile("a100").peak_flops
    assert Mesh.parse(f"{kind}:8").device == kind  # a mesh of it plans with 39.4 GiB per device


def test_an_unknown_gpu_gets_the_generic_entry_with_its_own_memory_and_says_so():
    kind = profile_for_gpu("Tesla T4", int(14.6 * GiB))
    assert kind == "generic_gpu_15g" and profile(kind).memory_gib == 14.6  # fits are checked against its memory
    assert "'Tesla T4' has no profile: the L40S's compute and bandwidth stand in" in profile(kind).source
    assert "register_profile" in profile(kind).source
    assert Mesh.parse(f"{kind}:2").device == kind
    assert profile_for_gpu("NVIDIA GeForce RTX 4090", int(23.6 * GiB)) == "generic_gpu_24g"


@pytest.mark.parametrize("name, memory, want", [
    ("NVIDIA H200", 139.8 * GiB, "h200"),
    ("NVIDIA A100-SXM4-40GB", 39.4 * GiB, "a100_39g"),
    ("Tesla T4", 14.6 * GiB, "generic_gpu_15g"),
])
def test_the_mesh_kind_is_the_gpu_torch_reports(monkeypatch, name, memory, want):
    """`rlgraph train`, the demo and the bench name their mesh with `detect_device_kind`: the device
    torch finds (here a monkeypatched one), on the index asked for."""
    import types

    import torch

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: asked.append(index) or types.SimpleNamespace(name=name, total_memory=int(memory)))
    assert detect_device_kind("cuda") == want and detect_device_kind("cuda:1") == want
    assert asked == [0, 1]


def test_the_cpu_is_the_cpu_profile():
    assert detect_device_kind("cpu") == "cpu"
