"""The code reward from the attacker's side: hostile completions must score 0 and harm nothing.

Every attack program defines `add` so that it returns the right answer (3 for `add(1, 2)`) only if
the attack worked: a score of 1 means the sandbox leaked. Each call must also return within the
timeout plus SLACK_S, and leave no sandbox process behind on the machine.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlgraph.errors import ConfigError
from rlgraph.rewards import CodeTests
from rlgraph.rewards import code_exec
from rlgraph.rewards import sandbox as sandbox_module

psutil = pytest.importorskip("psutil")

FAILURE = sandbox_module.bwrap_failure(sys.executable)
needs_bwrap = pytest.mark.skipif(FAILURE is not None, reason=f"the bubblewrap sandbox cannot run here ({FAILURE}); "
                                 "install bubblewrap (apt-get install bubblewrap) to run the isolation tests")
TIMEOUT_S = 1.5
# A sandbox starts in ~0.15 s here; the parent's SIGKILL and reaping add little. 3 s covers a loaded
# 2-core machine running two test workers.
SLACK_S = 3.0
ADD = ["assert add(1, 2) == 3"]
TAG = {"text": ""}


@pytest.fixture(autouse=True)
def tagged_harness(monkeypatch):
    """A tag unique to this test on the command line of every process its sandboxes start (forks keep it),
    so that tests running at the same time in other workers do not count as left behind."""
    TAG["text"] = f"rlgraph-attack-{os.getpid()}-{uuid.uuid4().hex}"
    monkeypatch.setattr(code_exec, "_HARNESS", code_exec._HARNESS + f"\n# {TAG['text']}\n")


def sandbox_processes() -> set[int]:
    found = set()
    for process in psutil.process_iter(["cmdline"]):
        if any(TAG["text"] in part for part in process.info["cmdline"] or ()):
            found.add(process.pid)
    return found


def left_behind(before: set[int], grace_s: float = 2.0) -> set[int]:
    """Sandbox processes that appeared during the call and are still alive after `grace_s`."""
    deadline = time.monotonic() + grace_s
    while (extra := sandbox_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    return extra


def attack(code: str, tests=ADD, kind: str = "asserts", **options) -> dict:
    """Run `code` against `tests`; check the time bound and that nothing survives; the run's result."""
    reward = CodeTests(timeout_s=TIMEOUT_S, **options)
    before = sandbox_processes()
    start = time.monotonic()
    result = reward.run(code, kind, tests)
    assert time.monotonic() - start < TIMEOUT_S + SLACK_S, result
    assert not left_behind(before), f"processes outlived the reward: {result}"
    return result


# -- escapes and exhaustion ------------------------------------------------------------------------------
# Signals: the trainer surviving is checked by this test process going on (and by the test below);
# the programs return a wrong `add` so that the policy's score is 0 whatever the signal did.
KILL_PARENT = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\ndef add(a, b): return 0"
ESCAPES = {
    "kill the trainer": KILL_PARENT,
    "stop the trainer": "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\ndef add(a, b): return 0",
    "kill everything it can see": "import os, signal\nos.kill(-1, signal.SIGKILL)\ndef add(a, b): return 0",
    "stop itself": "import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)\ndef add(a, b): return 3",
    "sleep forever": "import time\ntime.sleep(10**6)\ndef add(a, b): return 3",
    "spin forever": "while True: pass",
    "read /etc/hostname": "open('/etc/hostname').read()\ndef add(a, b): return 3",
    "read the repo": f"open({__file__!r}).read()\ndef add(a, b): return 3",
    "read the trainer's environment": "import os\nsecret = ''\nfor p in os.listdir('/proc'):\n    try:\n"
                                      "        secret += open(f'/proc/{p}/environ').read()\n    except OSError:\n"
                                      "        pass\ndef add(a, b): return 3 if 'hunter2' in secret else 0",
    "write outside /tmp": "import os\nfor path in ('/pwned', '/dev/pwned', '/dev/shm/pwned', '/usr/pwned', '/proc/pwned'):\n"
                          "    try:\n        open(path, 'w').write('x')\n        ok = True\n"
                          "    except OSError:\n        pass\ndef add(a, b): return 3 if 'ok' in globals() else 0",
    "fill the tmpfs": "n = 0\ntry:\n    for i in range(10**4):\n        open(f'/tmp/f{i}', 'w').write('x' * 2**20)\n"
                      "        n += 1\nexcept OSError:\n    pass\ndef add(a, b): return 3 if n > 64 else 0",
    "fork 400 processes": "import os, time\nn = 0\nfor _ in range(400):\n    try:\n        if os.fork() == 0:\n"
                          "            time.sleep(60)\n            os._exit(0)\n        n += 1\n    except OSError:\n"
                          "        break\ndef add(a, b): return 3 if n >= 400 else 0",
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "double-forked setsid daemon": "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                                   "        while True:\n            time.sleep(0.05)\n    os._exit(0)\n"
                                   "def add(a, b): return 0",
    "memory blow-up": "blob = bytearray(4 * 1024**3)\ndef add(a, b): return 3",
    "memory blow-up in children": "import os\nfor _ in range(6):\n    if os.fork() == 0:\n"
                                  "        try:\n            blob = bytearray(4 * 1024**3)\n"
                                  "        finally:\n            os._exit(0)\n"
                                  "def add(a, b): return 0",
    "new user namespace": "import ctypes\nok = ctypes.CDLL(None).unshare(0x10000000) == 0  # CLONE_NEWUSER\n"
                          "def add(a, b): return 3 if ok else 0",
}


@needs_bwrap
@pytest.mark.parametrize("name", list(ESCAPES))
def test_escapes_score_zero_end_in_time_and_leave_nothing(name, tmp_path, monkeypatch):
    monkeypatch.setenv("RLGRAPH_ATTACK_SECRET", "hunter2")
    assert Path("/etc/hostname").exists() or name != "read /etc/hostname"
    result = attack(ESCAPES[name])
    assert result["passed"] == 0, result
    if name in ("sleep forever", "spin forever", "stop itself", "fork bomb"):
        assert result["timed_out"]


@needs_bwrap
def test_signals_never_reach_host_processes():
    # A stand-in for the trainer's other processes: the code is told its real pid.
    helper = subprocess.Popen(["sleep", "30"])
    try:
        code = "".join(f"for pid in (os.getppid(), {helper.pid}, {os.getpid()}):\n    try:\n"
                       f"        os.kill(pid, {sig})\n        hits += 1\n    except OSError:\n        pass\n"
                       for sig in ("signal.SIGSTOP", "signal.SIGKILL") if True)
        code = "import os, signal\nhits = 0\n" + code.replace(f", {os.getpid()}):", "):", 1)  # never SIGSTOP us
        attack(code + "def add(a, b): return 3 if hits else 0")
        assert psutil.Process(helper.pid).status() in (psutil.STATUS_SLEEPING, psutil.STATUS_RUNNING)
        assert helper.poll() is None
    finally:
        helper.kill()
        helper.wait()


@needs_bwrap
def test_writes_never_reach_the_run_directory_or_the_repo(tmp_path):
    targets = [tmp_path / "pwned", Path(__file__).parent / "pwned"]
    code = "".join(f"try:\n    open({str(t)!r}, 'w').write('x')\nexcept OSError:\n    pass\n" for t in targets)
    assert attack(code + "def add(a, b): return 3")["passed"] == 1  # the code ran; its writes went nowhere
    assert not any(target.exists() for target in targets)


@needs_bwrap
def test_no_tcp_to_a_listener_on_the_trainers_loopback():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        code = (f"import _socket\ns = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\ns.settimeout(1)\n"
                f"s.connect(('127.0.0.1', {port}))\ndef add(a, b): return 3")
        assert attack(code)["passed"] == 0
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected


@needs_bwrap
def test_no_unix_sockets_of_the_host(tmp_path):
    path = tmp_path / "trainer.sock"
    abstract = f"\0rlgraph-attack-{os.getpid()}"
    with socket.socket(socket.AF_UNIX) as by_path, socket.socket(socket.AF_UNIX) as by_name:
        by_path.bind(str(path))
        by_name.bind(abstract)
        for server in (by_path, by_name):
            server.listen(1)
            server.setblocking(False)
        code = "import socket\nreached = 0\n" + "".join(
            f"try:\n    socket.socket(socket.AF_UNIX).connect({address!r})\n    reached += 1\nexcept OSError:\n    pass\n"
            for address in (str(path), abstract)) + "def add(a, b): return 3 if reached else 0"
        assert attack(code)["passed"] == 0
        for server in (by_path, by_name):
            with pytest.raises(BlockingIOError):
                server.accept()


@needs_bwrap
@pytest.mark.parametrize("how", ["os.write", "print", "a huge value", "a value just under the parse bound"])
def test_huge_output_is_cut_at_the_cap_with_bounded_parent_memory(how):
    writer = {"os.write": "os.write(1, chunk)", "print": "print(chunk.decode(), end='')"}.get(how, "pass")
    code = f"import os\nchunk = b'x' * 2**16\nfor _ in range(2**14):\n    {writer}\n"  # 1 GiB
    code += {"a huge value": "def add(a, b): return [[]] * 200_000",  # 800 KB: fits the output cap
             "a value just under the parse bound": "def add(a, b): return [[]] * 21000"}.get(how, "def add(a, b): return 3")
    process, samples, done = psutil.Process(), [], threading.Event()
    rss = process.memory_info().rss
    sampler = threading.Thread(target=lambda: [samples.append(process.memory_info().rss) or time.sleep(0.002)
                                               for _ in iter(done.is_set, True)])
    sampler.start()  # the peak during the call, not what is left after it
    try:
        result = attack(code)
    finally:
        done.set()
        sampler.join()
    # The reader keeps at most output_bytes (1 MiB) plus one 64 KiB chunk, and parses a value of at most
    # 64 KiB (~30 MB at peak in ast.literal_eval); 64 MiB leaves room for the allocator, and is far below
    # the 1 GiB the code wrote or the ~500 MB a 1 MiB literal would take to parse.
    assert max(samples) - rss < 64 * 2**20
    assert result["passed"] == 0 and not result["timed_out"]


# -- forging the verdict ---------------------------------------------------------------------------------
# Each returns the wrong value (0 for add(1, 2)) and tries to be scored as passing anyway.
FORGERIES = {
    "claim every value through sys.__stdout__": (
        "import sys, json\nframe = sys._getframe()\nwhile 'request' not in frame.f_locals:\n    frame = frame.f_back\n"
        "ids = [s[1] for t in frame.f_locals['request']['tests'] for s in t.get('steps', ()) if s[0] == 'eval']\n"
        "for i in ids:\n    for value in ('True', 'None', '[]'):\n"
        "        sys.__stdout__.write(json.dumps({'leaf': i, 'repr': value}) + '\\n')\n"
        "sys.__stdout__.flush()\ndef add(a, b): return 0"),
    "read the nonce from __main__": (
        "import sys\nmain = vars(sys.modules['__main__'])\n"
        "secret = [v for k, v in main.items() if 'nonce' in k.lower()]\n"
        "def add(a, b): return 3 if secret else 0"),
    "patch compile": "import builtins\nbuiltins.compile = lambda *a, **k: compile('1', '', 'eval')\n"
                     "def add(a, b): return 0",
    "patch repr and eval": "import builtins\nbuiltins.repr = lambda v: 'True'\nbuiltins.eval = lambda *a: True\n"
                           "def add(a, b): return 0",
    "os._exit before the asserts": "import os\nos._exit(0)",
    "records of the wrong types": "import os\nfor key in ('leaf', 'case', 'test', 'error', 'repr', 'passed'):\n"
                                  "    os.write(1, ('{\"%s\": [[]], \"repr\": {}, \"stdout\": \"x\"}\\n' % key).encode())\n"
                                  "def add(a, b): return 0",
    "a line that crashes a JSON parser": "import os\nos.write(1, b'[' * 200_000 + b'\\n')\ndef add(a, b): return 0",
    "an object equal to everything": "class Any:\n    def __eq__(self, other): return True\n"
                                     "    __hash__ = object.__hash__\ndef add(a, b): return Any()",
    "a str subclass equal to everything": "class S(str):\n    def __eq__(self, other): return True\n"
                                          "def add(a, b): return S('x')",
    "raise SystemExit(0)": "raise SystemExit(0)",
}


@needs_bwrap
@pytest.mark.parametrize("name", list(FORGERIES))
def test_forgeries_score_zero(name):
    assert attack(FORGERIES[name], tests=ADD + ["assert add(2, 2) == 4"])["passed"] == 0


@needs_bwrap
@pytest.mark.parametrize("name", list(FORGERIES))
def test_nothing_passes_a_test_that_cannot_pass(name):
    # `assert 1 == 2` has no value for the code to produce: the parent decides it alone.
    assert attack(FORGERIES[name], tests=["assert 1 == 2", "x = 1\nassert x == 2"])["passed"] == 0


@needs_bwrap
def test_stdin_stdout_tests_are_compared_outside_and_survive_forged_records():
    cases = [{"input": "abc", "output": "cba"}, {"input": "xy", "output": "yx"}]
    forged = FORGERIES["records of the wrong types"].replace("def add(a, b): return 0", "print(input())")
    claims = "import os\nfor case in range(2):\n    os.write(1, b'{\"case\": %d, \"stdout\": \"forged\"}\\n' % case)\n"
    for code in (forged, claims + "print(input())"):
        assert attack(code, tests=cases, kind="io")["passed"] == 0
    assert attack("print(input()[::-1])", tests=cases, kind="io")["passed"] == 2


@needs_bwrap
def test_expected_values_never_enter_the_completions_run():
    # The code searches its whole process for the expected values and returns what it finds.
    hunt = ("import gc, sys\ndef add(a, b):\n    found = [o for o in gc.get_objects() if isinstance(o, (list, dict))]\n"
            "    texts = [x for o in found for x in (o.values() if isinstance(o, dict) else o) if isinstance(x, str)]\n"
            "    texts += [sys.stdin.read()] if not sys.stdin.closed else []\n"
            "    return next((t for t in texts if t.startswith('expected-')), None)")
    tests = ["assert add(1, 2) == 'expected-3'",
             "answer = 'expected-' + str(4)\nassert add(2, 2) == answer",
             "import math\nassert add(3, 3) == 'expected-' + str(math.factorial(3))"]
    result = attack(hunt, tests=tests)
    assert result["passed"] == 0, result
    honest = "def add(a, b):\n    import math\n    return 'expected-' + str(a + b if a != 3 else math.factorial(3))"
    assert attack(honest, tests=tests)["passed"] == 3


SNIPPETS = st.sampled_from([ESCAPES[name] for name in ("kill the trainer", "stop the trainer", "read /etc/hostname",
                                                       "fork 400 processes", "double-forked setsid daemon",
                                                       "memory blow-up", "write outside /tmp")]
                           + [FORGERIES[name] for name in ("claim every value through sys.__stdout__", "patch compile",
                                                           "an object equal to everything")])


@needs_bwrap
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(SNIPPETS, min_size=2, max_size=3))
def test_composed_attacks_score_zero(snippets):
    # Each snippet in its own try block, then a wrong `add`: no combination may pass or linger.
    body = "".join("try:\n" + "".join(f"    {line}\n" for line in snippet.splitlines()) +
                   "except BaseException:\n    pass\n" for snippet in snippets)
    assert attack(body + "def add(a, b): return 0")["passed"] == 0


@needs_bwrap
def test_the_trainer_survives_and_honest_code_still_scores():
    before = os.getpid()
    attack(KILL_PARENT)
    assert os.getpid() == before and attack("def add(a, b): return a + b")["passed"] == 1


# -- without bubblewrap ----------------------------------------------------------------------------------
@pytest.fixture
def bwrap_at(monkeypatch):
    """Pretend bwrap is at a given path (None: absent); the cached probe is forgotten before and after."""
    def use(path: str | None) -> None:
        monkeypatch.setattr(sandbox_module, "bwrap_path", lambda: path)
    sandbox_module.bwrap_failure.cache_clear()
    yield use
    sandbox_module.bwrap_failure.cache_clear()


def test_without_bubblewrap_the_reward_refuses_and_says_how_to_fix(bwrap_at):
    bwrap_at(None)
    with pytest.raises(ConfigError, match=r"(?s)bubblewrap.*apt-get install bubblewrap.*isolation='none'"):
        CodeTests()


def test_a_bwrap_that_cannot_start_a_sandbox_is_refused_at_construction(bwrap_at):
    # e.g. a container that forbids user namespaces: bwrap is there but every run would score 0.
    bwrap_at("/bin/false")
    with pytest.raises(ConfigError, match=r"(?s)cannot run a program here: bwrap failed.*user namespaces"):
        CodeTests()


def test_isolation_none_is_an_explicit_loud_opt_in():
    with pytest.warns(RuntimeWarning, match="isolation='none'.*only for code you trust"):
        reward = CodeTests(timeout_s=5, isolation="none")
    assert reward.run("def add(a, b): return a + b", "asserts", ADD)["passed"] == 1


@pytest.mark.parametrize("bad", [dict(isolation="bwarp"), dict(isolation=None), dict(isolation=0),
                                 dict(max_processes=0), dict(max_processes="8"), dict(max_processes=True),
                                 dict(output_bytes=-1), dict(output_bytes=1.5), dict(output_bytes="1MiB"),
                                 dict(allow_forgeable_tests="yes"), dict(allow_forgeable_tests=1),
                                 dict(allow_forgeable_tests=None), dict(python=3), dict(python="/nonexistent/python3"),
                                 dict(python=__file__)])  # a file, not executable
def test_bad_sandbox_options_are_config_errors_naming_the_option(bad):
    (name, value), = bad.items()
    with pytest.raises(ConfigError, match=f"code: {name}="):
        CodeTests(**bad)


@needs_bwrap
def test_a_fork_bomb_does_not_starve_the_other_completions_of_the_batch():
    # Process limits are per sandbox (its own user namespace), so concurrent honest samples still run.
    reward = CodeTests(timeout_s=TIMEOUT_S, workers=6)
    bomb, honest = "```python\n" + ESCAPES["fork bomb"] + "\n```", "def add(a, b):\n    return a + b"
    before = sandbox_processes()
    start = time.monotonic()
    assert reward([bomb, honest] * 3, tests=[ADD] * 6) == [0.0, 1.0] * 3
    assert time.monotonic() - start < TIMEOUT_S + SLACK_S and not left_behind(before)


def test_as_root_the_sandbox_runs_an_interpreter_uid_65534_can_reach(tmp_path):
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    python = closed / "python3"
    python.write_text("")
    python.chmod(0o755)
    if os.geteuid() != 0:
        assert sandbox_module.sandbox_python(str(python)) == str(python)  # no uid change: it runs as we do
    elif os.path.exists(sandbox_module.SYSTEM_PYTHON):
        assert sandbox_module.sandbox_python(str(python)) == sandbox_module.SYSTEM_PYTHON
    else:
        with pytest.raises(ConfigError, match="cannot reach the interpreter"):
            sandbox_module.sandbox_python(str(python))


@needs_bwrap
def test_the_sandbox_sees_the_interpreter_but_not_its_neighbours():
    # The trainer's own interpreter (a venv's python links to the real one): its executable and
    # stdlib are mounted, not its prefix (a python in ~/bin must not expose ~).
    script = "import os, sys\nprint(sys.version_info[:2], sorted(os.listdir(os.path.dirname(sys.executable))))"
    command = sandbox_module.bwrap_command(sandbox_module.bwrap_path(), sys.executable, script,
                                           sandbox_module.SandboxLimits())
    done = subprocess.run(command, capture_output=True, text=True, cwd="/", timeout=30)
    real = os.path.realpath(sys.executable)
    listing = sorted(os.listdir(os.path.dirname(real))) if real.startswith("/usr/") else [os.path.basename(real)]
    assert done.stdout.strip() == f"{tuple(sys.version_info[:2])} {listing}", done.stderr
