"""The program the code sandbox runs (`python -I -S -c <this file's text>`); the standard library only.

It reads one request (JSON) from stdin and prints one JSON line per result. It holds no expected
value and decides nothing: it runs the completion's code and reports plain values (the `repr` of
each expression it was asked to evaluate, or the stdout of each stdin/stdout case). The parent
compares them with what it expects (rlgraph/rewards/code_verdict.py). Everything here runs in the
same interpreter as the untrusted code, so any line it prints is only a *claim* the code could
have made itself; the design makes such claims worth no more than honestly computed values.

Request: {"code": str, "output_bytes": int, "mode": "io", "inputs": [str, ...]}
      or {"code": str, "output_bytes": int, "mode": "asserts",
          "tests": [{"steps": [["exec", src] | ["eval", leaf_id, src], ...]} | {"opaque": src}, ...]}
"""

import io
import json
import os
import resource
import sys

MAX_ITEMS = 100_000  # an iterator is listed up to this many items; more reports an error


def emit(record):
    OUT.write(json.dumps(record) + "\n")
    OUT.flush()


class CappedText(io.StringIO):
    """stdout/stderr for the completion: kept in memory up to a byte budget, then writes fail."""

    def __init__(self, cap, initial=""):
        super().__init__(initial)
        self.cap = cap

    def write(self, text):
        if self.tell() + len(text) > self.cap:
            raise OSError("output over the sandbox's limit")
        return super().write(text)


def plain(value, depth=0):
    """`value` as plain data (iterators listed, frozensets as sets) so that its repr is a literal."""
    if depth > 50:
        raise ValueError("the value is nested too deeply")
    if isinstance(value, (bool, int, float, complex, str, bytes, type(None))):
        return value
    if isinstance(value, (list, tuple)):
        items = [plain(item, depth + 1) for item in value]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, (set, frozenset)):
        return {plain(item, depth + 1) for item in value}
    if isinstance(value, dict):
        return {plain(k, depth + 1): plain(v, depth + 1) for k, v in value.items()}
    if hasattr(value, "__next__") or isinstance(value, range):
        items = []
        for item in value:
            items.append(plain(item, depth + 1))
            if len(items) > MAX_ITEMS:
                raise ValueError("the iterator yields too many items")
        return items
    return value  # its repr is probably not a literal: the parent then counts the check as failed


def literal(value):
    """The text of `value` that ast.literal_eval reads back: repr, but infinities as 1e999."""
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return "1e999" if value > 0 else "-1e999"
    if type(value) in (list, tuple, set) and value:
        items = ", ".join(literal(item) for item in value)
        return {list: "[%s]", tuple: "(%s,)" if len(value) == 1 else "(%s)", set: "{%s}"}[type(value)] % items
    if type(value) is dict:
        return "{" + ", ".join(f"{literal(k)}: {literal(v)}" for k, v in value.items()) + "}"
    return repr(value)


def run_code(code, stdin_text, cap):
    """Exec the completion with `stdin_text` as stdin; (namespace, stdout text)."""
    sys.stdin, sys.stdout, sys.stderr = io.StringIO(stdin_text), CappedText(cap), CappedText(cap)
    try:
        namespace = {"__name__": "__main__", "__builtins__": __builtins__}
        exec(compile(code, "solution.py", "exec"), namespace)
        return namespace, sys.stdout.getvalue()
    finally:
        sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, OUT, sys.__stderr__


def describe(exc):
    return f"{type(exc).__name__}: {exc}"[:500]


def run_io(request):
    for case, stdin_text in enumerate(request["inputs"]):
        try:
            _, out = run_code(request["code"], stdin_text, request["output_bytes"])
            emit({"case": case, "stdout": out})
        except BaseException as exc:  # noqa: B036 - SystemExit and KeyboardInterrupt are the code's too
            emit({"case": case, "error": describe(exc)})


def run_steps(number, steps, namespace, cap):
    for step in steps:
        sys.stdout = sys.stderr = CappedText(cap)
        try:
            if step[0] == "exec":
                exec(compile(step[1], f"test{number}", "exec"), namespace)
            else:
                value = eval(compile(step[2], f"test{number}", "eval"), namespace)
                emit({"leaf": step[1], "repr": literal(plain(value))[:cap]})
        except BaseException as exc:  # noqa: B036
            emit({"leaf": step[1], "error": describe(exc)} if step[0] == "eval" else
                 {"test": number, "error": describe(exc)})
            if step[0] == "exec":
                return
        finally:
            sys.stdout, sys.stderr = OUT, sys.__stderr__


def run_asserts(request):
    cap = request["output_bytes"]
    try:
        namespace, _ = run_code(request["code"], "", cap)
    except BaseException as exc:  # noqa: B036
        emit({"error": describe(exc)})
        return
    for number, test in enumerate(request["tests"]):
        if "steps" in test:
            run_steps(number, test["steps"], dict(namespace), cap)
            continue
        try:  # an opaque test (opted in): its verdict is this harness's word, which the code can forge
            exec(compile(test["opaque"], f"test{number}", "exec"), dict(namespace))
            emit({"test": number, "passed": True})
        except BaseException as exc:  # noqa: B036
            emit({"test": number, "error": describe(exc)})


def main():
    # Before any of the code runs; it cannot raise them again (see rlgraph/rewards/sandbox.py).
    for name, value in json.loads(os.environ.get("RLGRAPH_LIMITS", "{}")).items():
        resource.setrlimit(getattr(resource, name), (value, value))
    request = json.loads(sys.stdin.read())
    sys.stdin.close()
    (run_io if request["mode"] == "io" else run_asserts)(request)


OUT = sys.stdout
if __name__ == "__main__":  # `python -c` runs it; importing it (tests, linters) does nothing
    main()
