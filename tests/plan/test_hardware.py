"""Hardware profiles: one table for memory and speed; users add their own."""

import pytest

from rlgraph.plan import hardware as H
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
