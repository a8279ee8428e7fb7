"""`rg.compile` refuses what is not an algorithm, a mesh or a set of sizes, naming the argument."""

import pytest

import rlgraph as rg
from rlgraph.algorithms import ALGORITHMS
from rlgraph.errors import ConfigError


def plain(state, prompts):
    return state, {}


@pytest.mark.parametrize("algo", [plain, "grpo", None])
def test_compile_needs_an_algorithm(algo):
    with pytest.raises(ConfigError, match=r"rg.compile: .* is not an algorithm\n  fix: decorate the function with @rg.algorithm"):
        rg.compile(algo)


@pytest.mark.parametrize("mesh", [8, 8.0, ["gpu", 8]])
def test_compile_refuses_a_mesh_that_is_no_mesh(mesh):
    with pytest.raises(ConfigError, match="cannot parse mesh"):
        rg.compile(ALGORITHMS["grpo"], mesh=mesh)


@pytest.mark.parametrize("sizes, message", [({"B": 4, "P": 4}, "has no T"), ({"P": 4, "T": 4}, "has no B"),
                                            ({"B": 0, "P": 4, "T": 4}, "B=0"), ({"B": 4, "P": 4, "T": -1}, "T=-1"),
                                            ({"B": "4", "P": 4, "T": 4}, "B='4'"), ({"B": 4, "P": 2.5, "T": 4}, "P=2.5")])
def test_compile_refuses_sizes_naming_the_dim(sizes, message):
    with pytest.raises(ConfigError, match=message):
        rg.compile(ALGORITHMS["grpo"], mesh="cpu:2", sizes=sizes)
