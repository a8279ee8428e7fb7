"""`key=value` text from the command line and the config: one reading for every flag.

    parse_value("1e-3", "-p kl")             -> 0.001     (YAML's own resolver would keep "1e-3" a string)
    parse_assignment("train.steps=10", "-o") -> ("train.steps", 10)
    parse_assignments(["kl=0.04", "loss=gspo"], "-p") -> {"kl": 0.04, "loss": "gspo"}

A value is read as a YAML scalar or flow collection (`true`, `null`, `[a, b]`, `{k: v}`) with
YAML 1.2's plain scalars, as a Python user expects: a number in exponent form without a dot
(`1e-3`) is a float, `None` is null, and only true/false (any case) are booleans (YAML 1.1 would
read `yes`, `no`, `on`, `off` as booleans: `estimator=on` would be True). `-p kl=1e-3` and `-o algorithm.hparams.kl=1e-3` therefore give the same float.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import yaml

from rlgraph.errors import ConfigError

# YAML 1.1 (PyYAML) needs a dot in a float ("1.0e-3"); YAML 1.2 and Python do not.
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def parse_value(text: str, where: str) -> Any:
    """`text` as a value; `where` (e.g. "-p kl", "--placement") names it in the error."""
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as error:
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"{where}={text}: {text!r} is not a value ({problem})",
                          fix="write a number, true/false, null, a word, [a, b] or {key: value}; "
                              "quote text with special characters, e.g. 'a: b'") from None
    plain = text.strip()
    if isinstance(value, bool) and plain.lower() not in ("true", "false"):
        return plain  # yes/no/on/off: a word
    if isinstance(value, str) and plain == value:  # an unquoted word: maybe a number YAML 1.1 missed
        if _NUMBER.fullmatch(value):
            return float(value)
        if value == "None":
            return None
    return value


def parse_assignment(item: str, flag: str, example: str = "key=value") -> tuple[str, Any]:
    """`key=value` -> (key, value); `flag` (e.g. "-o") and `example` go into the error."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"{flag} {item!r} must be written key=value", fix=f"e.g. {flag} {example}")
    key = key.strip()
    return key, parse_value(text, f"{flag} {key}")


def parse_assignments(items: Iterable[str], flag: str, example: str = "key=value") -> dict[str, Any]:
    """Each `key=value` of `items` into one dict; a key given twice is an error naming it."""
    values: dict[str, Any] = {}
    for item in items:
        key, value = parse_assignment(item, flag, example)
        if key in values:
            raise ConfigError(f"{flag} {key} is given twice ({key}={values[key]!r} and {item})",
                              fix=f"give {flag} {key}=... once")
        values[key] = value
    return values
