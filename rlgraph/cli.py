"""The `rlgraph` command line.

    rlgraph list [algorithms|estimators|losses]       what can be named, with one line of doc each
    rlgraph trace <algorithm> [-p key=value ...]       print the typed program
    rlgraph plan <algorithm> [--mesh ...] [-p ...]     compile and print the placement plan
                                                       (<algorithm>: a name, or yours: my_algos.py:fn, module:fn)
    rlgraph demo [--algorithm grpo] [-p key=value ...] SFT then RL on the arithmetic task, on CPU
    rlgraph train CONFIG [-o key=value ...]            a run on your model, data and rewards (docs/training.md)
    rlgraph train CONFIG --runtime spmd --nproc 2      the same, on 2 worker processes (= -o runtime.runtime=...)
    rlgraph train --resume RUN_DIR                     continue a run exactly where its last checkpoint left it
    rlgraph train --resume RUN_DIR --checkpoint 300    ... from an older checkpoint (the later ones are deleted)
    rlgraph eval RUN_DIR [--data FILE]                 score a checkpoint of a run on held-out prompts
    rlgraph export RUN_DIR OUT                         the trained policy as a Hugging Face directory
    rlgraph plot RUN_DIR                               PNG curves of a run's metrics
    rlgraph bench [--config small|large]               rlgraph vs TRL's GRPOTrainer, side by side
    rlgraph check estimator|loss <name>                the properties every estimator or loss must have
    rlgraph serve --keys FILE --state-dir DIR          a Tinker-compatible training server (docs/service.md)

A value of -p or -o is read as YAML (1e-3 is a float, [a, b] a list, 'quoted' text a string).
Hyper-parameters that name an estimator or a loss take any registered name, e.g.
`rlgraph trace grpo -p estimator=rloo -p loss=gspo`. `--import my_module` (or a .py path; any
command, repeatable) imports the user's module first, so its `@F.estimator`s and `F.register_loss`
calls register: `rlgraph plan grpo --import my_estimators -p estimator=loo_rank_bonus`.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any


def _pairs(pairs: list[str], flag: str = "-p") -> dict[str, Any]:
    """`-p key=value ...` as a dict, each value read as `-o` reads it (`rlgraph.ir.keyvalue`)."""
    from rlgraph.ir.keyvalue import parse_assignments

    return parse_assignments(pairs, flag, "kl=1e-3 or -p estimator=rloo")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help="import a module (dotted name, found from the working directory too) or a .py file first, "
                        "so its @F.estimator / F.register_loss names can be used")
    parser = argparse.ArgumentParser(prog="rlgraph", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error, not only its message")
    # also accepted after the command (rlgraph plan grpo --debug); SUPPRESS keeps the subcommand from resetting it
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)

    listing = sub.add_parser("list", parents=[common], help="list the algorithms, estimators and losses you can name")
    listing.add_argument("what", nargs="?", choices=("algorithms", "estimators", "losses"), help="one section only")

    demo = sub.add_parser("demo", parents=[common], help="SFT then RL (GRPO by default) on the arithmetic task, on CPU")
    demo.add_argument("--algorithm", default="grpo", help="the RL algorithm: grpo, ppo, dapo, rloo, ... (rlgraph list)")
    demo.add_argument("-p", "--param", action="append", default=[],
                      help="RL hyper-parameter key=value, e.g. lam=1.0 or estimator=rloo")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--rl-seconds", type=float, default=120.0)
    demo.add_argument("--rl-lr", type=float, default=1e-4)
    demo.add_argument("--critic-lr", type=float, default=1e-4, help="PPO's critic")
    demo.add_argument("--run-dir", default="runs/demo")
    demo.add_argument("--runtime", choices=("local", "spmd", "ray"), default="local",
                      help="local: every role in this process; spmd: --nproc worker processes on this machine, the "
                      "policy FSDP2-sharded; ray: --nproc Ray actors (a local cluster, or --address)")
    demo.add_argument("--address", default=None, help="ray: the cluster to join, e.g. auto after `ray start --head`")
    demo.add_argument("--nproc", type=_positive_int, default=2, help="spmd worker processes (mesh ranks)")
    demo.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                      help="where the models run (every runtime): cuda when a GPU is present (auto), else cpu")
    demo.add_argument("--timeout", type=float, default=None,
                      help="spmd: seconds a step may wait on a worker before failing (default 60 on CPU, 600 on CUDA)")
    demo.add_argument("--rl-steps", type=_positive_int, default=None, help="stop RL after this many steps (default: time-bound)")

    train = sub.add_parser("train", parents=[common], help="train from a config (YAML or .py): your model, data, rewards")
    train.add_argument("config", nargs="?", help="the config file (examples/*.yaml); optional with --resume")
    train.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. -o train.steps=10 -o optimizer.lr=1e-5")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue this run from its latest checkpoint")
    train.add_argument("--overwrite", action="store_true",
                       help="a fresh run may write into a run_dir holding files rlgraph did not write")
    train.add_argument("--checkpoint", metavar="STEP",
                       help="with --resume: start from this step number or step-* directory (later ones are deleted)")
    train.add_argument("--dry-run", action="store_true", help="print the compiled plan and memory per rank, then exit")
    # shorthands for -o runtime.<key>=...; None: the config's value
    train.add_argument("--runtime", choices=("local", "spmd", "ray"), help="= -o runtime.runtime=...: local, spmd or ray")
    train.add_argument("--nproc", type=_positive_int, help="= -o runtime.nproc=...: spmd/ray worker processes (mesh ranks)")
    train.add_argument("--device", choices=("auto", "cpu", "cuda"), help="= -o runtime.device=...: where the models run")

    export = sub.add_parser("export", parents=[common], help="write a run's policy as a Hugging Face directory")
    export.add_argument("run_dir")
    export.add_argument("out")
    export.add_argument("--checkpoint", help="a step number or step-* directory of the run (default: the latest)")
    export.add_argument("--adapter", action="store_true", help="LoRA runs: write the peft adapter, not merged weights")
    export.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")

    evaluate = sub.add_parser("eval", parents=[common], help="score a run's checkpoint on held-out prompts with its rewards")
    evaluate.add_argument("run_dir")
    evaluate.add_argument("--checkpoint", help="a step number or step-* directory of the run (default: the latest)")
    evaluate.add_argument("--data", metavar="FILE", help="prompts to score, read with the run's data settings "
                                                         "(default: the run's held-out split)")
    evaluate.add_argument("--max-prompts", type=int, metavar="N", help="score the first N prompts only")
    evaluate.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                          help="override a key of the run's config, e.g. -o eval.max_new_tokens=64")

    plot = sub.add_parser("plot", parents=[common], help="write PNG curves (reward, accuracy, KL, length, throughput)")
    plot.add_argument("run_dir")
    plot.add_argument("--out", help="where the PNGs go (default: RUN_DIR/plots)")

    # every argument, --help too, goes to the benchmark's own parser (rlgraph.bench.main): see `main`
    sub.add_parser("bench", parents=[common], add_help=False, help="rlgraph vs TRL GRPOTrainer on the same model, data, "
                   "reward; rlgraph bench --config small|large (rlgraph bench --help for the rest)")

    check = sub.add_parser("check", parents=[common],
                           help="property-test a registered estimator or loss (rlgraph.testing); prints a counterexample")
    check.add_argument("kind", choices=("estimator", "loss"))
    check.add_argument("name", help="a registered name (rlgraph list), e.g. rloo, or yours with --import")
    check.add_argument("--thorough", action="store_true", help="500 examples per property instead of 25")

    trace = sub.add_parser("trace", parents=[common], help="print an algorithm's typed program")
    trace.add_argument("algorithm", help="a name (rlgraph list algorithms) or your @rg.algorithm: my_algos.py:fn, module:fn")
    trace.add_argument("-p", "--param", action="append", default=[], help="hyper-parameter key=value, e.g. loss=gspo")
    trace.add_argument("--source", action="store_true", help="show the source line of every value")

    plan = sub.add_parser("plan", parents=[common],
                          help="compile an algorithm and print its placement plan (runs nothing)")
    plan.add_argument("algorithm", help="a name (rlgraph list algorithms) or your @rg.algorithm: my_algos.py:fn, module:fn")
    plan.add_argument("--mesh", default="gpu:8", help="e.g. gpu:8, h200:8, 2x8:h100, cpu:2")
    plan.add_argument("--placement", default="colocated",
                      help="auto (the compiler searches) | colocated | colocated:fsdp=8,tp=2[,cpu_offload=True] | "
                           "split:policy=4,rollout=4[,ref=policy][,tp=2][,cpu_offload=True]")
    plan.add_argument("--engine", default="auto",
                      help="generation engine: auto (native on a cpu mesh, vllm on GPUs), native (tp=1) or vllm")
    plan.add_argument("--model", default="tiny-qwen2", help="a preset (e.g. llama3-70b) or a config.json / model directory")
    plan.add_argument("--sizes", default="B=32,P=64,T=256", help="concrete dims, e.g. B=64,P=512,T=1024")
    plan.add_argument("-p", "--param", action="append", default=[], help="hyper-parameter key=value, e.g. estimator=rloo")
    plan.add_argument("--staleness", default="0", help="asynchronous RL: generate each batch up to k versions "
                      "before the one it trains (0: synchronous); the plan prints both lanes")
    plan.add_argument("--env-workers", help="rg.rollout: step the environments in k worker processes per "
                      "generating rank (default: in the rank's own process); the rollout stage says where")
    plan.add_argument("--micro-batch-tokens", help="packed sequences: micro-batches of at most this many real tokens, "
                      "no padding (docs/training.md); the plan prints them")
    plan.add_argument("--pixel-budget", help="vision-language models: the most pixels an image keeps after resizing "
                      "(default 1003520: 1280 image tokens of 28x28); the plan counts its image tokens (docs/vlm.md)")
    plan.add_argument("--images-per-prompt", default="1", help="vision-language models: images a prompt carries")
    plan.add_argument("--dot", help="write the Graphviz diagram here (.dot; .svg/.png rendered if Graphviz is installed)")
    plan.add_argument("--json", help="write the plan as JSON here")

    serve = sub.add_parser("serve", parents=[common], help="a Tinker-compatible training server: LoRA tenants on one "
                           "base model over HTTP (docs/service.md)")
    serve.add_argument("--model", default="tiny", help="tiny, or a local Hugging Face model directory")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--runtime", default="local", help="local (one process), spmd (--nproc worker processes, the "
                       "base FSDP2-sharded over them) or ray (--nproc Ray actors, likewise)")
    serve.add_argument("--nproc", type=_positive_int, default=None, help="spmd/ray: worker ranks, >= 2 (default 2)")
    serve.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (cuda is untested)")
    serve.add_argument("--engine", default="native", help="the samplers' generation engine: native, or vllm "
                       "(--runtime local; base and adapters through vLLM's LoRA: docs/service.md)")
    serve.add_argument("--max-lora-rank", type=int, default=128, help="--engine vllm: the largest tenant rank its "
                       "engine takes (1..128; vLLM pads every adapter to it, so smaller samples faster)")
    serve.add_argument("--keys", help="a file of API keys, one a line (or $RLGRAPH_SERVE_KEYS, comma-separated)")
    serve.add_argument("--state-dir", required=True, help="where saved states live (they survive a restart)")
    serve.add_argument("--insecure-local", action="store_true", help="serve without keys, on a loopback host only")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; any error is printed as one message and exits 1 (`--debug`: with its traceback)."""
    from rlgraph.errors import RLGraphError
    from rlgraph.train.user_code import import_modules

    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":  # `rlgraph bench --config small` and `rlgraph bench -- --config small` alike
        args.args = [arg for arg in rest if arg != "--"]
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    commands = {"list": _list, "check": _check, "demo": _demo, "trace": _trace, "plan": _plan, "train": _train,
                "export": _export, "eval": _eval, "plot": _plot, "bench": _bench, "serve": _serve}
    try:
        import_modules(args.imports)  # rlgraph.train.user_code: the same rules as a config's `imports`
        return commands[args.command](args)
    except KeyboardInterrupt:  # Ctrl-C outside a run: one line, and the shell's exit status for SIGINT
        print(f"rlgraph {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - a command line answers every failure with a message, not a traceback
        if args.debug:
            traceback.print_exc()
        # rlgraph's own errors are written for the user; any other names its type, which is the clue to what broke
        text = str(exc) if isinstance(exc, RLGraphError) else f"{type(exc).__name__}: {exc}"
        hint = "" if args.debug or isinstance(exc, RLGraphError) else "\n  (rlgraph --debug ... shows the traceback)"
        print(f"rlgraph {args.command}: {text}{hint}", file=sys.stderr)
        return 1


def _serve(args) -> int:
    from rlgraph.service.serve import serve

    serve(args.model, host=args.host, port=args.port, state_dir=args.state_dir, keys_file=args.keys,
          insecure_local=args.insecure_local, runtime=args.runtime, device=args.device,
          nproc=args.nproc if args.nproc is not None else (1 if args.runtime == "local" else 2), engine=args.engine,
          max_lora_rank=args.max_lora_rank)
    return 0


def _trace(args) -> int:
    from rlgraph.train.user_code import load_algorithm

    algorithm = load_algorithm(args.algorithm, "algorithm")
    print(_traced(algorithm, _pairs(args.param)).pretty(source=args.source))
    return 0


def _traced(algorithm: Any, hparams: dict[str, Any]) -> Any:
    """`algorithm.trace(**hparams)`; a hyper-parameter out of range names the `-p` flag that set it."""
    from rlgraph.errors import ConfigError, TraceError

    try:
        return algorithm.trace(**hparams)
    except TraceError as error:
        name = getattr(error, "hparam", None)
        if name not in hparams:
            raise
        raise ConfigError(f"-p {name}={hparams[name]!r}: {error.summary}",
                          fix=error.fix and error.fix.replace(f"pass {name}", f"-p {name}")) from None


def _demo(args) -> int:
    from rlgraph.algorithms import ALGORITHMS
    from rlgraph.errors import ConfigError, did_you_mean
    from rlgraph.train.demo import RL_ALGORITHMS, DemoConfig, run_demo

    if args.algorithm not in RL_ALGORITHMS:
        raise ConfigError(f"--algorithm {args.algorithm!r} is not an RL algorithm of the demo"
                          f"{did_you_mean(args.algorithm, RL_ALGORITHMS)}", fix=f"one of {', '.join(RL_ALGORITHMS)}")
    hparams = _pairs(args.param)
    _traced(ALGORITHMS[args.algorithm], hparams)  # a wrong name or hyper-parameter fails now, not after SFT
    run_demo(DemoConfig(algorithm=args.algorithm, hparams=hparams, seed=args.seed, rl_seconds=args.rl_seconds,
                        rl_lr=args.rl_lr, critic_lr=args.critic_lr, run_dir=args.run_dir, runtime=args.runtime,
                        nproc=args.nproc, device=args.device, rl_max_steps=args.rl_steps, timeout_s=args.timeout,
                        address=args.address))
    return 0


def _train(args) -> int:
    from rlgraph.errors import ConfigError
    from rlgraph.train.config import load_config
    from rlgraph.train.run import dry_run, load_run_config, train

    args.override = _with_runtime_flags(args)
    if args.resume:
        config = load_run_config(args.resume, args.override)
        if args.config is not None:
            given = load_config(args.config, args.override)
            for section in ("algorithm", "model", "rollout", "data", "rewards"):
                if getattr(given, section) != getattr(config, section):
                    raise ConfigError(f"--resume {args.resume}: {args.config} has another {section} section than the run",
                                      fix="resume without a config (the run's own config.yaml is used), or start a new run")
    elif args.config is None:
        raise ConfigError("rlgraph train needs a CONFIG file or --resume RUN_DIR", fix="rlgraph train examples/math_grpo/config.yaml, or rlgraph train --resume runs/math_grpo")
    else:
        config = load_config(args.config, args.override)
        written = config.directory / "config.yaml"
        if written.resolve() == Path(args.config).resolve():
            raise ConfigError(f"run_dir {config.directory}: the run would write its resolved config.yaml over "
                              f"{args.config}, the config you ran (even with --overwrite)",
                              fix="choose another run_dir, e.g. runs/<name>, or rename the config file")
    if args.overwrite and args.resume:
        raise ConfigError("--overwrite applies to a fresh run; a resume writes only into its own run",
                          fix=f"rlgraph train --resume {args.resume} (without --overwrite)")
    if args.dry_run:
        dry_run(config)
        return 0
    try:
        result = train(config, resume=bool(args.resume), checkpoint=args.checkpoint, overwrite=args.overwrite)
    except KeyboardInterrupt:  # Ctrl-C: the run's `with` blocks have stopped its workers on the way out
        print(f"rlgraph train: interrupted; {_last_checkpoint(config.directory)}", file=sys.stderr)
        return 130
    shown = (f"; held-out accuracy {result.eval_before:.1%} -> {result.eval_after:.1%}"
             if result.eval_before is not None and result.eval_after is not None else "")
    print(f"run {result.run_dir}: {result.steps} steps in {result.seconds:.0f} s{shown}")
    return 0


def _last_checkpoint(run_dir: Path) -> str:
    """Where an interrupted run stands: its last whole checkpoint and the command that goes on from it."""
    from rlgraph.train.checkpoint import latest_checkpoint

    last = latest_checkpoint(run_dir) if run_dir.is_dir() else None
    if last is None:
        return f"{run_dir} holds no checkpoint yet (the first is written after the warm start)"
    return f"the last checkpoint of {run_dir} is {last.name}; rlgraph train --resume {run_dir} goes on from it"


_RUNTIME_FLAGS = {"--runtime": ("runtime", "runtime.runtime"), "--nproc": ("nproc", "runtime.nproc"),
                  "--device": ("device", "runtime.device")}


def _with_runtime_flags(args) -> list[str]:
    """`rlgraph train`'s -o list with --runtime/--nproc/--device added as the -o they stand for;
    a flag and an -o of the same key with another value is an error naming both."""
    from rlgraph.errors import ConfigError
    from rlgraph.ir.keyvalue import parse_assignment

    given = dict(parse_assignment(item, "-o") for item in args.override)
    added = []
    for flag, (attribute, key) in _RUNTIME_FLAGS.items():
        value = getattr(args, attribute)
        if value is None:
            continue
        if key in given and given[key] != value:
            raise ConfigError(f"{flag} {value} and -o {key}={given[key]} disagree",
                              fix=f"give one of them: {flag} is short for -o {key}=...")
        added.append(f"{key}={value}")
    return [*args.override, *added]


def _export(args) -> int:
    from rlgraph.train.export import export_run

    out = export_run(args.run_dir, args.out, checkpoint=args.checkpoint, adapter=args.adapter, overwrite=args.overwrite)
    print(f"exported {args.run_dir} -> {out} (AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0


def _eval(args) -> int:
    from rlgraph.errors import ConfigError
    from rlgraph.train.evaluation import evaluate_run

    if args.max_prompts is not None and args.max_prompts < 1:
        raise ConfigError(f"--max-prompts {args.max_prompts}: give a number >= 1")
    result = evaluate_run(args.run_dir, checkpoint=args.checkpoint, data=args.data, max_prompts=args.max_prompts,
                          overrides=args.override)
    print(f"{result['checkpoint']} (step {result['step']}) on {result['data']}, {result['prompts']} prompts, greedy: "
          f"accuracy ({result['accuracy_reward']}) {result['eval/accuracy']:.1%}, reward {result['eval/reward']:.3f}, "
          f"response length {result['eval/response_length']:.1f} tokens -> {result['saved']}")
    return 0


def _plot(args) -> int:
    from rlgraph.train.plot import plot_run

    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0


def _bench(args) -> int:
    from rlgraph.bench import main as bench_main

    return bench_main(args.args)


_PROPERTY_NAMES = {"assert_padding_invariant": "padding invariance", "assert_microbatch_invariant": "micro-batch invariance",
                   "assert_group_permutation_equivariant": "group-permutation equivariance",
                   "assert_finite": "finiteness", "assert_singleton_groups_zero": "singleton groups give 0"}


def _check(args) -> int:
    """Run the properties every estimator (padding invariance, group-permutation equivariance,
    finiteness, singleton groups give 0) or loss (micro-batch invariance, padding invariance) must
    have; 1 and the counterexample on failure."""
    import attrs

    import rlgraph.testing as rgt
    from rlgraph import functional as F

    profile = rgt.load_profile("thorough" if args.thorough else None)
    if args.kind == "estimator":
        entry = F.get_estimator(args.name)

        def subject(b):
            return entry(b.rewards, b.group, n=b.n, mask=b.mask)

        checks = [rgt.assert_padding_invariant, rgt.assert_group_permutation_equivariant, rgt.assert_finite,
                  rgt.assert_singleton_groups_zero]
    else:
        entry = F.get_loss(args.name)

        def subject(b):
            return entry(b.logprobs, b.old_logprobs, b.advantages, b.mask)

        checks = [rgt.assert_microbatch_invariant, rgt.assert_padding_invariant]
    subject.__qualname__ = args.name
    for check in checks:
        prop = _PROPERTY_NAMES[check.__name__]
        with warnings.catch_warnings(record=True) as caught:  # hundreds of draws repeat one warning: summarised below
            warnings.simplefilter("always")
            try:
                check(subject)
            except rgt.PropertyFailure as failure:
                example = attrs.evolve(failure.counterexample, source=_registered_call(args.kind, args.name))
                print(f"{args.kind} {args.name}: FAILED {prop}\n{example}{_warning_summary(caught)}")
                return 1
        print(f"{args.kind} {args.name}: {prop} holds ({profile} profile){_warning_summary(caught)}")
    return 0


def _registered_call(kind: str, name: str) -> str:
    """The checked function as the counterexample calls it: the registered entry on a batch's fields."""
    fn = name if name.isidentifier() else "fn"
    args = "batch.rewards, batch.group, n=batch.n, mask=batch.mask" if kind == "estimator" else \
        "batch.logprobs, batch.old_logprobs, batch.advantages, batch.mask"
    return (f"def {fn}(batch):  # as rlgraph check calls it (--import the module that registers it)\n"
            f"    return F.get_{kind}({name!r})({args})")


def _warning_summary(caught: list) -> str:
    """The warnings a check raised, each distinct one once with its count, indented under the verdict."""
    counts: dict[tuple, int] = {}
    for w in caught:
        file = os.path.relpath(w.filename) if w.filename.startswith(os.getcwd() + os.sep) else w.filename
        text = str(w.message).split("\n")[0].split(" (Triggered internally at")[0]  # torch's C++ location says nothing here
        key = (w.category.__name__, text, file, w.lineno)
        counts[key] = counts.get(key, 0) + 1
    return "".join(f"\n  warning ({count}x) {kind} at {file}:{line}: {text}"
                   for (kind, text, file, line), count in counts.items())


def _list(args) -> int:
    """Print each registry as `name  one-line doc`, under a header saying where the names go."""
    for title, (where, rows) in _listings().items():
        if args.what in (None, title):
            print(f"{title} ({where}):")
            width = max(map(len, rows), default=0) + 2
            for name, doc in rows.items():
                print(f"  {name:<{width}}{doc}")
    return 0


def _listings() -> dict[str, tuple[str, dict[str, str]]]:
    from rlgraph import functional as F
    from rlgraph.algorithms import ALGORITHMS
    from rlgraph.functional.registry import summary

    def taking(hparam: str) -> str:  # the algorithms whose hyper-parameter `hparam` takes these names
        names = [name for name, algo in ALGORITHMS.items() if hparam in inspect.signature(algo.fn).parameters]
        return f"-p {hparam}=<name> for {', '.join(names)}" if names else "by name in your own algorithms"

    algorithms = {name: summary(sys.modules[algo.fn.__module__].__doc__) for name, algo in sorted(ALGORITHMS.items())}
    estimators = {name: entry.doc for name, entry in F.ESTIMATORS.items()}
    losses = {name: f"{entry.doc} Returns (loss, {', '.join(entry.metrics)})." for name, entry in F.LOSSES.items()}
    return {
        "algorithms": ("rlgraph trace|plan <name>, rlgraph demo --algorithm <name>", algorithms),
        "estimators": (f"group advantage estimators: {taking('estimator')}; F.get_estimator(name)", estimators),
        "losses": (f"policy losses: {taking('loss')}; F.get_loss(name)", losses),
    }


def _plan(args) -> int:
    import rlgraph as rg
    from rlgraph.plan.dot import render
    from rlgraph.plan.mesh import parse_placement
    from rlgraph.errors import ConfigError
    from rlgraph.train.user_code import load_algorithm

    algorithm = load_algorithm(args.algorithm, "algorithm")
    _check_output_dirs(args)
    sizes = _sizes(args.sizes)
    hparams = _pairs(args.param)
    _traced(algorithm, hparams)  # a hyper-parameter out of range names its -p flag
    sizes.setdefault("n", hparams.get("n", 8))
    try:
        compiled = rg.compile(algorithm, mesh=args.mesh, placement=parse_placement(args.placement),
                              sizes=sizes, models={"policy": args.model}, engine=args.engine,
                              staleness=_staleness(args.staleness), env_workers=_env_workers(args.env_workers),
                              micro_batch_tokens=_micro_batch_tokens(args.micro_batch_tokens),
                              pixel_budget=_whole(args.pixel_budget, "--pixel-budget", 1, "--pixel-budget 401408"),
                              images_per_prompt=_whole(args.images_per_prompt, "--images-per-prompt", 0,
                                                       "--images-per-prompt 1"), **hparams)
    except ValueError as exc:  # placement and model-size mistakes; RLGraphError is handled by main
        if isinstance(exc, ConfigError) and exc.summary.startswith("micro_batch_tokens="):  # named by its flag
            raise ConfigError(f"--micro-batch-tokens {exc.summary.split('=', 1)[1]}",
                              fix=exc.fix and exc.fix.replace("micro_batch_tokens >=", "--micro-batch-tokens")) from None
        print(f"rlgraph plan: {exc}", file=sys.stderr)
        return 1
    print(compiled.as_text())
    if args.dot:
        dot = compiled.to_dot()
        base = args.dot.rsplit(".", 1)[0]
        with open(base + ".dot", "w") as handle:
            handle.write(dot)
        rendered = render(dot, args.dot) if not args.dot.endswith(".dot") else None
        print(f"diagram: {base}.dot" + (f", {rendered}" if rendered else ""))
    if args.json:
        with open(args.json, "w") as handle:
            handle.write(compiled.plan.to_json())
    return 0


def _whole(text: str | None, flag: str, low: int, example: str) -> int | None:
    """A flag's whole number >= `low` (None: not given), the flag named when it is not one."""
    from rlgraph.errors import ConfigError

    if text is None:
        return None
    if not text.strip().isdigit() or int(text) < low:
        raise ConfigError(f"{flag} {text}: not a whole number >= {low}", fix=example)
    return int(text)


def _micro_batch_tokens(text: str | None) -> int | None:
    """`--micro-batch-tokens k` as a whole number >= 1 (None: not given), the flag named when it is not one."""
    from rlgraph.errors import ConfigError

    if text is None:
        return None
    if not text.strip().isdigit() or int(text) < 1:
        raise ConfigError(f"--micro-batch-tokens {text}: not a whole number of tokens >= 1",
                          fix="--micro-batch-tokens 4096 (packed micro-batches of at most 4096 real tokens)")
    return int(text)


def _staleness(text: str) -> int:
    """`--staleness k` as a whole number >= 0, the flag named when it is not one."""
    from rlgraph.errors import ConfigError

    if not text.strip().isdigit():
        raise ConfigError(f"--staleness {text}: not a whole number >= 0 (0: synchronous; k: each batch is generated "
                          "by a policy at most k versions older than the one it trains)", fix="--staleness 1")
    return int(text)


def _env_workers(text: str | None) -> int | None:
    """`--env-workers k` as a whole number >= 1 (absent: None), the flag named when it is not one."""
    from rlgraph.errors import ConfigError

    if text is None:
        return None
    if not text.strip().isdigit() or int(text) < 1:
        raise ConfigError(f"--env-workers {text}: not a whole number >= 1 (the env worker processes per generating "
                          "rank; leave the flag out to step environments in the rank's own process)",
                          fix="--env-workers 2")
    return int(text)


def _sizes(text: str) -> dict[str, int]:
    """`--sizes B=64,P=512,T=1024` as counts; a value that is not a whole number is named with the flag."""
    from rlgraph.errors import ConfigError

    sizes = {}
    for key, value in _pairs([item for item in text.split(",") if item], "--sizes").items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"--sizes {text}: {key}={value!r} is not a whole number", fix="write e.g. --sizes B=32,P=64,T=256")
        sizes[key] = value
    return sizes


def _check_output_dirs(args) -> None:
    """Refuse --dot/--json into a directory that does not exist before compiling, not after."""
    from rlgraph.errors import ConfigError

    for flag, path in (("--dot", args.dot), ("--json", args.json)):
        folder = os.path.dirname(path) if path else ""
        if folder and not os.path.isdir(folder):
            raise ConfigError(f"{flag} {path}: the directory {folder!r} does not exist",
                              fix=f"create it first (mkdir -p {folder}) or write the file elsewhere")


if __name__ == "__main__":
    sys.exit(main())
