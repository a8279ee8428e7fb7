"""Code-execution reward: run each completion's code against the row's tests in a sandbox.

    CodeTests(timeout_s=5, memory_mb=512)(completions, tests=[...])  -> fraction of tests passed

The code is the last fenced block of the completion (```python ... ``` or ``` ... ```), else the
whole completion. A row's `tests` (the field is `tests_field`, passed through `data.extra_fields`)
is one of:
  - a string of Python with top-level asserts: one test, passed when every assert holds;
  - a list of such strings: each counted on its own;
  - a list of {"input": str, "output": str}: the code runs as a script with that stdin, and passes
    when its stdout equals `output` (both stripped).

Model-written code is treated as hostile. It runs in a bubblewrap sandbox (rlgraph/rewards/sandbox.py:
no network, no host files but /usr and the interpreter, read-only; a capped /tmp; bounded time,
memory, processes and output; every process killed at the end), and it never decides its own
score: the sandbox reports plain values (an expression's repr, a case's stdout) and this process
compares them with expected values the sandbox never saw (rlgraph/rewards/code_verdict.py).
Without bubblewrap, CodeTests refuses to run unless `isolation="none"` is passed, which keeps only
resource limits and is no security boundary. docs/security.md has the threat model.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlgraph.errors import ConfigError, did_you_mean
from rlgraph.rewards.code_verdict import TestsPlan, UnverifiableTest, plan_tests
from rlgraph.rewards.sandbox import SandboxLimits, SandboxOutcome, require_sandbox, run_sandboxed

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_HARNESS = open(os.path.join(os.path.dirname(__file__), "sandbox_harness.py"), encoding="utf-8").read()
ISOLATIONS = ("bwrap", "none")


def extract_code(completion: str) -> str:
    """The last fenced code block of `completion` (a python one preferred), else the whole text."""
    blocks = _FENCE.findall(completion)
    if not blocks:
        return completion
    python = [body for language, body in blocks if language.lower() in ("python", "py", "python3")]
    return (python or [body for _, body in blocks])[-1]


def _cases(tests: Any, row: int, field: str) -> tuple[str, list[Any]]:
    """("asserts" or "io", cases) from a row's tests; a ValueError naming the row when malformed."""
    if isinstance(tests, str):
        return "asserts", [tests]
    if isinstance(tests, (list, tuple)) and tests:
        if all(isinstance(t, str) for t in tests):
            return "asserts", list(tests)
        if all(isinstance(t, dict) and {"input", "output"} <= set(t) for t in tests):
            return "io", [{"input": str(t["input"]), "output": str(t["output"])} for t in tests]
    raise ValueError(f"code: row {row}'s {field!r} is {type(tests).__name__} {str(tests)[:80]!r}; expected a string "
                     "of asserts, a non-empty list of them, or a list of {input, output} objects")


class CodeTests:
    """Score = fraction of a row's tests the completion's code passes (`partial=False`: 1.0 only if all).

    isolation: "bwrap" (default; needs bubblewrap) or "none" (resource limits only: NOT a security
    boundary, for code you trust). max_processes: processes the code may have at once. output_bytes:
    the most the code may print (per stdin/stdout case, per value and in all). allow_forgeable_tests:
    run tests whose asserts sit inside a block (HumanEval's `check(candidate)`) with the verdict
    decided inside the sandbox, where the code can forge it; refused by default.
    """

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, partial: bool = True, tests_field: str = "tests",
                 workers: int | None = None, python: str | None = None, isolation: str = "bwrap",
                 max_processes: int = 8, output_bytes: int = 1 << 20, allow_forgeable_tests: bool = False):
        for name, value, low in (("timeout_s", timeout_s, 0), ("memory_mb", memory_mb, 32)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > low:
                raise ConfigError(f"code: {name}={value!r} must be a number > {low}")
        for name, value, low in (("workers", workers, 1), ("max_processes", max_processes, 3),
                                 ("output_bytes", output_bytes, 1024)):
            if (value is not None or name != "workers") and \
                    (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ConfigError(f"code: {name}={value!r} must be a whole number >= {low}")
        if not isinstance(allow_forgeable_tests, bool):
            raise ConfigError(f"code: allow_forgeable_tests={allow_forgeable_tests!r} must be true or false")
        self.python = python or sys.executable
        if not isinstance(self.python, str) or not (os.path.isfile(self.python) and os.access(self.python, os.X_OK)):
            raise ConfigError(f"code: python={python!r} is not an executable file",
                              fix="pass the path of a Python 3 interpreter, or leave it out to use the trainer's")
        _check_isolation(isolation, self.python)
        self.timeout_s, self.memory_mb, self.partial = float(timeout_s), int(memory_mb), bool(partial)
        self.tests_field, self.workers = tests_field, workers or (os.cpu_count() or 1)
        self.isolation, self.allow_forgeable_tests = isolation, allow_forgeable_tests
        self.limits = SandboxLimits(timeout_s=self.timeout_s, memory_mb=self.memory_mb, max_processes=max_processes,
                                    output_bytes=output_bytes)

    @property
    def fields(self) -> tuple[str, ...]:
        """The per-row fields this reward reads (checked against the data before a run starts)."""
        return (self.tests_field,)

    def __call__(self, completions: Sequence[str], **meta: Any) -> list[float]:
        if self.tests_field not in meta:
            raise ValueError(f"code: the rollouts carry no {self.tests_field!r} field (they carry "
                             f"{', '.join(sorted(meta)) or 'none'}); list it in data.extra_fields")
        tests = meta[self.tests_field]
        jobs = [(extract_code(text), *_cases(case, row, self.tests_field)) for row, (text, case)
                in enumerate(zip(completions, tests, strict=True))]
        plans = [self._plan(kind, cases, row) for row, (_, kind, cases) in enumerate(jobs)]
        # One reference run per distinct row (a group's n completions share it), before the completions.
        distinct = {json.dumps(p.reference_tests): p for p in plans if p is not None and p.needs_reference}
        with ThreadPoolExecutor(self.workers) as pool:
            references = dict(zip(distinct, pool.map(self._reference_leaves, distinct.values())))
            results = list(pool.map(lambda job, plan: self.run(*job, plan=plan, reference=None if plan is None else
                                                                references.get(json.dumps(plan.reference_tests)))
                                    ["passed"] / len(job[2]), jobs, plans))
        return results if self.partial else [float(score == 1.0) for score in results]

    def _plan(self, kind: str, cases: list[Any], row: int | None = None) -> TestsPlan | None:
        if kind == "io":
            return None
        where = "a test" if row is None else f"row {row}'s {self.tests_field!r}"
        for number, case in enumerate(cases):
            try:
                plan_tests([case], self.allow_forgeable_tests)
            except UnverifiableTest as exc:
                raise ConfigError(f"code: {where}, test {number}, cannot be checked outside the sandbox: {exc}: "
                                  f"{case[:80]!r}", fix="write the test as top-level asserts (`assert f(1) == 2`), or "
                                  "pass allow_forgeable_tests=True to let the sandbox decide it (the code can then "
                                  "forge a pass; see docs/security.md)") from None
            except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:  # ValueError: a NUL byte (3.11)
                why = f"{exc.msg}, line {exc.lineno}" if isinstance(exc, SyntaxError) else f"{type(exc).__name__}: {exc}"
                raise ConfigError(f"code: {where}, test {number}, is not valid Python ({why}): {case[:80]!r}",
                                  fix="fix the dataset's test string") from None
        return plan_tests(cases, self.allow_forgeable_tests)

    def run(self, code: str, kind: str, cases: list[Any], plan: TestsPlan | None = None,
            reference: dict[str, str | None] | None = None) -> dict[str, Any]:
        """{"passed": int, "error": str | None, "timed_out": bool} of one program against its cases.

        `reference`: the reference leaves' values when already computed (else they are, alongside).
        """
        if kind == "io":
            outcome = self._sandbox({"code": code, "mode": "io", "inputs": [case["input"] for case in cases]})
            records = _records(outcome)
            outputs = {r["case"]: r["stdout"] for r in records
                       if isinstance(r.get("stdout"), str) and isinstance(r.get("case"), int)}
            passed = sum(outputs.get(i, "\0").strip() == case["output"].strip() for i, case in enumerate(cases))
            return _result(passed, outcome, records)
        plan = plan or self._plan(kind, cases)
        computed: list[dict[str, str | None]] = [reference or {}]
        helper = threading.Thread(target=lambda: computed.append(self._reference_leaves(plan)))
        started = plan.needs_reference and reference is None
        if started:
            helper.start()
        outcome = self._sandbox({"code": code, "mode": "asserts", "tests": plan.completion_tests})
        records = _records(outcome)
        leaves = _leaf_reprs(records, plan.completion_tests)
        if started:
            helper.join()
        leaves.update(computed[-1])  # nothing if the helper failed to start a sandbox: those leaves stay missing
        failed = {r["test"] for r in records if "error" in r and isinstance(r.get("test"), int)}
        if any("error" in r and not ({"test", "leaf"} & set(r)) for r in records):
            failed = set(range(len(cases)))  # the completion itself raised before any test ran
        opaque = {r["test"] for r in records if r.get("passed") is True and isinstance(r.get("test"), int)}
        return _result(sum(plan.passed(leaves, failed, opaque)), outcome, records)

    def _reference_leaves(self, plan: TestsPlan) -> dict[str, str | None]:
        """The values the test computes itself, from a run that holds no completion code."""
        outcome = self._sandbox({"code": "", "mode": "asserts", "tests": plan.reference_tests})
        return _leaf_reprs(_records(outcome), plan.reference_tests)

    def _sandbox(self, request: dict[str, Any]) -> SandboxOutcome:
        request["output_bytes"] = self.limits.output_bytes
        return run_sandboxed(_HARNESS, json.dumps(request).encode(), self.limits, self.python, self.isolation)

    def __repr__(self) -> str:
        return (f"CodeTests(timeout_s={self.timeout_s:g}, memory_mb={self.memory_mb}, partial={self.partial}, "
                f"isolation={self.isolation!r})")


def _check_isolation(isolation: Any, python: str) -> None:
    if isolation not in ISOLATIONS:
        raise ConfigError(f"code: isolation={isolation!r} is not one of {', '.join(map(repr, ISOLATIONS))}"
                          f"{did_you_mean(str(isolation), ISOLATIONS)}",
                          fix="use isolation='bwrap' (the sandbox; needs bubblewrap)")
    if isolation == "bwrap":
        require_sandbox(python)
    else:
        warnings.warn("code: isolation='none' runs model-written code with resource limits only: it can read and "
                      "write your files, reach the network and signal the trainer. Use it only for code you trust "
                      "(docs/security.md).", RuntimeWarning, stacklevel=3)


def _records(outcome: SandboxOutcome) -> list[dict[str, Any]]:
    """The JSON objects the harness printed, one a line; anything else the code printed is skipped."""
    records = []
    for line in outcome.stdout.decode("utf-8", "replace").splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # not JSON, or nested deep enough to exhaust the parser's stack
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _leaf_reprs(records: list[dict[str, Any]], tests: list[dict[str, Any]]) -> dict[str, str]:
    """leaf id -> reported repr, for the leaves this run was asked for (the first report of each wins)."""
    asked = {step[1] for test in tests for step in test.get("steps", ()) if step[0] == "eval"}
    leaves: dict[str, str] = {}
    for record in records:
        if not isinstance(record.get("leaf"), str):  # a list here would not even hash
            continue
        if record["leaf"] in asked and isinstance(record.get("repr"), str):
            leaves.setdefault(record["leaf"], record["repr"])
        elif record["leaf"] in asked:
            leaves.setdefault(record["leaf"], None)  # it raised: a later claim for it does not count either
    return leaves


def _result(passed: int, outcome: SandboxOutcome, records: list[dict[str, Any]]) -> dict[str, Any]:
    error = next((str(r["error"])[:500] for r in records if "error" in r), None)
    if outcome.timed_out:
        error = f"timed out after {outcome.seconds:.1f} s" + (f" ({error})" if error else "")
    elif outcome.output_exceeded:
        error = "the program printed more than the sandbox's output limit"
    elif error is None and not records:
        error = f"the program ended without a result (exit code {outcome.returncode})"
    return {"passed": int(passed), "error": error, "timed_out": outcome.timed_out}
