"""Meshes and layouts: the text a plan prints for them."""

from rlgraph.plan.mesh import GenerateLayout, Mesh


def test_a_generate_layout_prints_its_engine_once_place_has_named_it():
    assert str(GenerateLayout(2, 4, "vllm")) == "vllm tp=2 dp=4"
    assert str(GenerateLayout(1, 2, "native")) == "native tp=1 dp=2"
    assert str(GenerateLayout(2, 4)) == "tp=2 dp=4"  # an explicit layout before `place` names the engine


def test_mesh_text_names_nodes_devices_and_kind():
    assert str(Mesh.parse("4x8:h100")) == "4x8 h100" and str(Mesh.parse("cpu:2")) == "1x2 cpu"
