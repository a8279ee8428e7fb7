"""One reading of `key=value` for -p, -o, --placement and --sizes (`rlgraph.ir.keyvalue`)."""

import pytest

from rlgraph.errors import ConfigError
from rlgraph.ir.keyvalue import parse_assignment, parse_assignments, parse_value


@pytest.mark.parametrize("text, value", [
    ("1e-3", 0.001), ("-2E4", -20000.0), (".5", 0.5), ("3", 3), ("0.25", 0.25), ("true", True), ("False", False),
    ("null", None), ("None", None), ("", None), ("rloo", "rloo"), ("'1e-3'", "1e-3"), ("yes", "yes"), ("off", "off"),
    ("[1, 2]", [1, 2]), ("{a: 1}", {"a": 1}), ('"\\n"', "\n"),
])
def test_values_read_as_yaml_with_python_numbers_and_none(text, value):
    assert parse_value(text, "-p x") == value and type(parse_value(text, "-p x")) is type(value)


def test_minus_p_and_minus_o_read_one_value_alike():
    assert parse_assignments(["kl=1e-3", "loss=gspo"], "-p") == {"kl": 0.001, "loss": "gspo"}
    assert parse_assignment("algorithm.hparams.kl=1e-3", "-o") == ("algorithm.hparams.kl", 0.001)


@pytest.mark.parametrize("items, message", [
    (["kl"], "-p 'kl' must be written key=value"),
    (["=3"], "-p '=3' must be written key=value"),
    (["kl=[1"], "-p kl=[1: '[1' is not a value"),
    (["kl=1", "kl=2"], "-p kl is given twice (kl=1 and kl=2)"),
])
def test_bad_pairs_name_the_flag_and_the_text(items, message):
    with pytest.raises(ConfigError, match="fix: ") as error:
        parse_assignments(items, "-p")
    assert message in str(error.value)
