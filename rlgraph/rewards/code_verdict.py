"""The verdict of assert tests, computed by the parent over plain values: the sandbox only reports values.

    plan = plan_tests(["assert add(1, 2) == 3"])   # what each sandbox run evaluates, what the parent checks
    plan.completion_tests                           # sent with the completion's code
    plan.reference_tests                            # sent with no completion code (may be empty)
    plan.passed(values)                             # -> [bool] per test, from the runs' reported values

Each test string is parsed with `ast`. Its top-level statements run in order; an `assert EXPR` is
split into a *check* the parent evaluates itself (comparisons, `and`/`or`/`not`, arithmetic,
literals, indexing and a few pure builtins such as `len` and `sorted`) and *leaves*: the maximal
sub-expressions the parent does not evaluate (a call of the completion's function, a name). A leaf
is evaluated in a sandbox and comes back as the `repr` of its value, which the parent reads with
`ast.literal_eval`, so only plain data crosses (an object with a rigged `__eq__` cannot).

A leaf that uses only names the test binds itself from other such names (`import math`,
`expected = sorted(data)`) is a *reference* leaf: it is evaluated in a separate run with no
completion code, and the statements that bind such names go to the completion's run only when one
of its own leaves needs them. So the completion's run never holds an expected value: the code
sees the arguments it is called with, never what the answer should be, and whatever it prints is
worth what returning that value honestly would be.

A test with an `assert` inside a block (a loop, a function such as HumanEval's `check`) does not
fit; it is refused unless the user allows forgeable tests (then the sandbox's word decides it).
"""

from __future__ import annotations

import ast
import builtins
import math
import operator
from collections.abc import Mapping
from typing import Any

import attrs

# Pure functions the parent applies to plain values itself (so their results cannot be forged).
SAFE_CALLS: dict[str, Any] = {name: getattr(builtins, name) for name in (
    "abs", "all", "any", "bool", "dict", "float", "frozenset", "int", "len", "list", "max", "min", "reversed",
    "round", "set", "sorted", "str", "sum", "tuple")}
SAFE_CALLS["reversed"] = lambda seq: list(reversed(seq))
SAFE_CALLS["math.isclose"] = math.isclose  # MBPP's float tests: `assert math.isclose(area(2), 12.56, rel_tol=0.001)`
SAFE_KEYWORDS = {"math.isclose": {"rel_tol", "abs_tol"}, "sorted": {"reverse"}, "round": {"ndigits"}}
BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
           ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
           ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
UNARY = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_PRODUCT_ITEMS = 1_000_000  # `seq * n` on the parent side: a bound on what a claimed value can make it build
# A reported value is parsed with ast.literal_eval, which needs ~450 bytes per character at peak (a
# 64 KiB list literal: ~30 MB): this bounds what one claimed value can make the trainer allocate.
MAX_REPR_CHARS = 1 << 16
BUILTIN_NAMES = frozenset(dir(builtins))


class UnverifiableTest(ValueError):
    """A test the parent cannot split into checks and leaves (an assert inside a block, no assert)."""


class _Missing(Exception):
    """A leaf has no usable value: it raised, it was never reported, or its repr is not plain data."""


@attrs.frozen
class TestsPlan:
    completion_tests: list[dict[str, Any]]  # per test: {"steps": [...]} or {"opaque": src}
    reference_tests: list[dict[str, Any]]   # per test: {"steps": [...]}; all empty when no reference leaf
    checks: list[list[ast.expr] | None]      # per test: the parent's expressions (None: opaque)

    @property
    def needs_reference(self) -> bool:
        return any(test["steps"] for test in self.reference_tests)

    def passed(self, leaves: Mapping[str, Any], failed_tests: set[int], opaque_passed: set[int]) -> list[bool]:
        """Per test: every check holds on the leaves' values (`leaves`: id -> repr text; failed: ids)."""
        verdicts = []
        for number, checks in enumerate(self.checks):
            if checks is None:
                verdicts.append(number in opaque_passed and number not in failed_tests)
                continue
            try:
                verdicts.append(number not in failed_tests and all(bool(_evaluate(c, leaves)) for c in checks))
            except (_Missing, ArithmeticError, TypeError, ValueError, MemoryError, RecursionError, IndexError,
                    KeyError, AttributeError, OverflowError):
                verdicts.append(False)  # a value of the wrong kind fails the check, as the assert would
        return verdicts


def plan_tests(tests: list[str], allow_forgeable: bool = False) -> TestsPlan:
    """Split every test into sandbox steps and parent checks; UnverifiableTest or SyntaxError if one cannot be."""
    completion, reference, checks = [], [], []
    for number, source in enumerate(tests):
        try:
            steps, ref_steps, test_checks = _plan_one(number, source)
        except UnverifiableTest:
            if not allow_forgeable:
                raise
            completion.append({"opaque": source})
            reference.append({"steps": []})
            checks.append(None)
            continue
        completion.append({"steps": steps})
        reference.append({"steps": ref_steps})
        checks.append(test_checks)
    return TestsPlan(completion, reference, checks)


def _plan_one(number: int, source: str) -> tuple[list, list, list[ast.expr]]:
    module = ast.parse(source, mode="exec")
    if any(isinstance(node, ast.Assert) for stmt in module.body if not isinstance(stmt, ast.Assert)
           for node in ast.walk(stmt)):
        raise UnverifiableTest("it has an assert inside a block (a loop, a function, a with/try/if)")
    if not any(isinstance(stmt, ast.Assert) for stmt in module.body):
        raise UnverifiableTest("it has no top-level assert, so nothing can be checked outside the sandbox")
    pure: set[str] = set()  # names the test binds from test-only values
    items: list[tuple] = []  # (statement, is_pure) or (assert's check, [(leaf_id, leaf, is_reference)])
    for stmt in module.body:
        if isinstance(stmt, ast.Assert):
            splitter = _Splitter(f"{number}.{len(items)}", pure)
            items.append((splitter.visit(stmt.test), splitter.leaves))
        else:
            free, bound = _names(stmt)
            is_pure = free <= pure | BUILTIN_NAMES
            pure = pure | bound if is_pure else pure - bound
            items.append((stmt, is_pure))
    return _completion_steps(items), _reference_steps(items), [item[0] for item in items if isinstance(item[1], list)]


def _completion_steps(items) -> list[list]:
    """Steps for the completion's run: every statement touching its values, test-only ones when needed."""
    needed: set[str] = set()
    steps: list[list] = []
    for node, info in reversed(items):
        if isinstance(info, list):  # an assert: its completion leaves
            for leaf_id, leaf, is_reference in reversed(info):
                if not is_reference:
                    steps.append(["eval", leaf_id, ast.unparse(leaf)])
                    needed |= _names(leaf)[0]
        elif not info or _names(node)[1] & needed or _always_sent(node):
            steps.append(["exec", ast.unparse(node)])
            needed |= _names(node)[0]
    return steps[::-1]


def _always_sent(stmt: ast.stmt) -> bool:
    """Imports, and statements that bind nothing (`sys.setrecursionlimit(10**4)`): the code may rely on
    their effects, and they bind no expected value (assignments and defs are sent only when needed)."""
    return isinstance(stmt, (ast.Import, ast.ImportFrom)) or not _names(stmt)[1]


def _reference_steps(items) -> list[list]:
    """Steps for the run without completion code: the test-only statements, then the reference leaves."""
    leaves = [["eval", leaf_id, ast.unparse(leaf)] for _, info in items if isinstance(info, list)
              for leaf_id, leaf, is_reference in info if is_reference]
    if not leaves:
        return []
    steps = []
    for node, info in items:
        if isinstance(info, list):
            steps += [["eval", leaf_id, ast.unparse(leaf)] for leaf_id, leaf, is_reference in info if is_reference]
        elif info:
            steps.append(["exec", ast.unparse(node)])
    return steps


def _names(node: ast.AST) -> tuple[set[str], set[str]]:
    """(names it reads that it does not bind itself, names it binds): an over-approximation of `free`."""
    loaded, bound = set(), set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            (bound if isinstance(sub.ctx, (ast.Store, ast.Del)) else loaded).add(sub.id)
        elif isinstance(sub, ast.arg):
            bound.add(sub.arg)
        elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(sub.name)
        elif isinstance(sub, (ast.Import, ast.ImportFrom)):
            bound |= {(alias.asname or alias.name).split(".")[0] for alias in sub.names}
    return loaded - bound, bound


class _Splitter(ast.NodeTransformer):
    """Replaces every sub-expression the parent does not evaluate by a leaf name `__leaf_<id>`."""

    def __init__(self, prefix: str, pure: set[str]):
        self.prefix, self.pure, self.leaves = prefix, pure, []

    def generic_visit(self, node: ast.AST) -> ast.AST:
        if isinstance(node, ast.expr) and not _parent_evaluates(node):
            free = _names(node)[0]
            leaf_id = f"{self.prefix}.{len(self.leaves)}"
            self.leaves.append((leaf_id, node, free <= self.pure | BUILTIN_NAMES))
            return ast.Name(id=f"__leaf_{leaf_id}", ctx=ast.Load())
        if isinstance(node, ast.Call):  # the function's name stays; its arguments are split
            node.args = [self.visit(arg) for arg in node.args]
            for keyword in node.keywords:
                keyword.value = self.visit(keyword.value)
            return node
        return super().generic_visit(node)


def _parent_evaluates(node: ast.expr) -> bool:
    if isinstance(node, (ast.Constant, ast.List, ast.Tuple, ast.Set, ast.BoolOp, ast.Compare, ast.Slice, ast.Subscript)):
        return not any(isinstance(item, ast.Starred) for item in getattr(node, "elts", ()))
    if isinstance(node, ast.Dict):
        return None not in node.keys  # `{**d}` is left to the sandbox
    if isinstance(node, ast.UnaryOp):
        return type(node.op) in UNARY
    if isinstance(node, ast.BinOp):
        return type(node.op) in BINARY
    if isinstance(node, ast.Call):  # sorted(x), len(f(1)): the builtin's name, positional arguments only
        name = _call_name(node.func)
        return (name in SAFE_CALLS and all(k.arg in SAFE_KEYWORDS.get(name, ()) for k in node.keywords)
                and not any(isinstance(arg, ast.Starred) for arg in node.args))
    return False


def _call_name(func: ast.expr) -> str | None:
    """"len" for `len(...)`, "math.isclose" for `math.isclose(...)`, None for anything else."""
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return f"{func.value.id}.{func.attr}"
    return None


def read_value(text: Any) -> Any:
    """A leaf's reported repr as plain data; _Missing if it is not a literal (or too big)."""
    if not isinstance(text, str) or len(text) > MAX_REPR_CHARS:
        raise _Missing("no value")
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as exc:
        raise _Missing(f"not plain data: {exc}") from None


def _evaluate(node: ast.expr, leaves: Mapping[str, Any]) -> Any:
    """A tiny interpreter over plain values: the check of one assert, with the leaves' reported values."""
    if isinstance(node, ast.Name):
        return read_value(leaves.get(node.id.removeprefix("__leaf_")))
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = [_evaluate(item, leaves) for item in node.elts]
        return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict):
        return {_evaluate(k, leaves): _evaluate(v, leaves) for k, v in zip(node.keys, node.values, strict=True)}
    if isinstance(node, ast.BoolOp):  # short-circuits like Python: `x is not None and x[0] == 1`
        value = None
        for operand in node.values:
            value = _evaluate(operand, leaves)
            if bool(value) is isinstance(node.op, ast.Or):
                return value
        return value
    if isinstance(node, ast.Compare):
        left = _evaluate(node.left, leaves)
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            right = _evaluate(right_node, leaves)
            if not COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.UnaryOp):
        return UNARY[type(node.op)](_evaluate(node.operand, leaves))
    if isinstance(node, ast.BinOp):
        return _binary(type(node.op), _evaluate(node.left, leaves), _evaluate(node.right, leaves))
    if isinstance(node, ast.Subscript):
        return _evaluate(node.value, leaves)[_evaluate(node.slice, leaves)]
    if isinstance(node, ast.Slice):
        parts = (node.lower, node.upper, node.step)
        return slice(*(None if part is None else _evaluate(part, leaves) for part in parts))
    if isinstance(node, ast.Call):
        keywords = {k.arg: _evaluate(k.value, leaves) for k in node.keywords}
        return SAFE_CALLS[_call_name(node.func)](*(_evaluate(arg, leaves) for arg in node.args), **keywords)
    raise AssertionError(f"the splitter left a {type(node).__name__} to the parent")


def _binary(op: type, left: Any, right: Any) -> Any:
    if op is ast.Mult:  # [0] * 10**12 from claimed values would exhaust the trainer's memory
        for seq, count in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(count, int) \
                    and len(seq) * max(count, 0) > MAX_PRODUCT_ITEMS:
                raise _Missing("a repeated sequence over the parent's bound")
    if op is ast.Mod and isinstance(left, (str, bytes)):  # '%*d' % (10**9, 1) would build a 1 GB string
        raise _Missing("string formatting is left to the sandbox")
    return BINARY[op](left, right)
