"""Several rewards as one reward role, with a stated policy for rewards that fail.

    pipeline = RewardPipeline([RewardTerm("math", math_reward, 1.0),
                               RewardTerm("format", FormatRegex(r"\\d+$"), 0.1)],
                              on_error="zero", timeout_s=30)
    scores = pipeline(completions, **meta)     # sum_k weight_k * term_k, one float per completion
    pipeline.pop_metrics()                     # {"reward/math": mean, "reward/format": mean, "reward/errors": 0.0}

A term *fails* when it raises, runs past `timeout_s`, returns something other than one number per
completion, or returns NaN/inf for some completions. `on_error`:
  - "fail": raise a RewardError naming the term, what went wrong and the first bad sample (its
    index, prompt and completion; a term that raised is called again on each sample alone to find
    the one that raises), so nothing is trained on a wrong score;
  - "zero": score the failed samples 0 for that term (all of the call's samples when the term
    raised, timed out or returned a wrong shape; only the non-finite ones otherwise), count them
    in `reward/errors` (and `reward/<term>/errors`), and go on.

Under "zero" a term that failed on *every* sample since the last `pop_metrics` is flagged
(`reward/<term>/all_failed` = 1) and its first error kept in `last_failures`: a reward of 0.000
that is really a broken reward must not look like a policy that learnt nothing.

`samples=k` keeps k (prompt, completion, reward) rows per call period for logging (`pop_samples`),
spread evenly over the first call's rows, so they show several prompts.

`workers=k` runs the terms in a pool of k supervised worker processes (`rlgraph.rewards.reward_pool`),
the terms of one call concurrently: a term that runs past `timeout_s`, dies, or stops itself gets
its worker killed and replaced, and its samples are scored by `on_error` like any failure ("timed
out after 600 s", "killed by signal 9 (SIGKILL)", "exited with code 3"); nothing it does reaches the
controller. The terms reach the workers by reference (module-level functions) or through `recipe`.
`workers=0` (the default here; `rlgraph train` defaults to a pool) calls them in this process, for
debugging: a term that times out there keeps running in a daemon thread (Python cannot stop one).
Call `close()` when done (the pool's processes are killed then, and at interpreter exit).
"""

from __future__ import annotations

import queue
import functools
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import attrs

from rlgraph.errors import ConfigError, RewardError
from rlgraph.rewards.reward_pool import RewardPool
from rlgraph.rewards.term import TermFailure, describe_raised, run_term


@attrs.frozen
class RewardTerm:
    name: str
    fn: Callable[..., Any]
    weight: float = 1.0


class _TermThread:
    """A daemon thread that runs in-process reward terms under a timeout, kept across calls (starting
    a thread a call cost 0.1-0.8 ms of the small bench's ~15 ms step, more on a loaded machine). A
    term that outlives its timeout keeps the thread; its owner starts another. Daemon, so a hung term
    never holds up the process's exit."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._work, name="reward-terms", daemon=True).start()

    def stop(self) -> None:
        """The thread ends after the job it runs, if any."""
        self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, completions, meta, answers = job
            try:
                answers.put(run_term(fn, completions, meta))
            except TermFailure as failure:
                answers.put(failure)
            except BaseException as exc:  # SystemExit and the like: reported in the caller's thread
                answers.put(TermFailure(f"raised {describe_raised(exc)}", list(range(len(completions))), raised=True))

    def run(self, fn: Callable[..., Any], completions: Sequence[str], meta: dict[str, Any],
            timeout_s: float) -> list[float] | TermFailure | None:
        """The term's answer, or None when it did not answer within `timeout_s`."""
        answers: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs.put((fn, completions, meta, answers))
        try:
            return answers.get(timeout=timeout_s)
        except queue.Empty:
            return None


class RewardPipeline:
    """Callable `(completions, **meta) -> list[float]`: the weighted sum of its terms."""

    def __init__(self, terms: Sequence[RewardTerm], *, on_error: Literal["fail", "zero"] = "fail",
                 timeout_s: float | None = None, samples: int = 0, workers: int = 0,
                 recipe: Callable[[], Sequence[Callable[..., Any]]] | None = None, memory_mb: int = 4096,
                 isolation: str = "auto"):
        if not terms:
            raise ConfigError("a reward pipeline needs at least one reward term")
        names = [term.name for term in terms]
        if len(set(names)) != len(names):
            raise ConfigError(f"reward terms {names} repeat a name; give each term once")
        if on_error not in ("fail", "zero"):
            raise ConfigError(f"reward_on_error={on_error!r} is not one of 'fail', 'zero'")
        if timeout_s is not None and not timeout_s > 0:
            raise ConfigError(f"reward_timeout_s={timeout_s!r} must be > 0 (or null for no limit)")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise ConfigError(f"logging.samples={samples!r} must be a whole number >= 0 (0: log no samples)")
        self.terms, self.on_error, self.timeout_s, self.samples = list(terms), on_error, timeout_s, samples
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._errors: dict[str, int] = {}
        self._first_error: dict[str, str] = {}
        self._samples: list[dict[str, Any]] = []
        self.last_failures: dict[str, str] = {}  # term -> first error, for terms that failed on every sample
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ConfigError(f"reward_workers={workers!r} must be a whole number >= 0 "
                              "(0: score in the controller process, for debugging)")
        # The recipe rebuilds the term functions in each worker; by default they travel by reference.
        recipe = recipe or functools.partial(_functions, tuple(term.fn for term in self.terms))
        self.pool = RewardPool(recipe, workers, memory_mb=memory_mb, isolation=isolation) if workers else None

    def describe(self) -> str:
        """Where the terms run, as the plan prints it on the score step."""
        limit = f"timeout {self.timeout_s:g} s" if self.timeout_s is not None else "no timeout"
        if self.pool is None:
            return f"reward functions in the controller process (reward_workers: 0), {limit}"
        return f"reward functions on the controller's reward pool: {self.pool.describe()}, {limit}"

    def start(self) -> None:
        """Start the reward workers, if any, without waiting for them (else the first call starts them)."""
        if self.pool is not None:
            self.pool.start()

    def close(self) -> None:
        """Stop the reward workers, if any, and the timeout thread (they start again on the next call)."""
        if self.pool is not None:
            self.pool.close()
        if getattr(self, "_thread", None) is not None:
            self._thread.stop()
            self._thread = None

    def __call__(self, completions: Sequence[str], **meta: Any) -> list[float]:
        total = [0.0] * len(completions)
        per_term = {}
        answers = self._answers([(term, completions, meta) for term in self.terms])
        for term, answer in zip(self.terms, answers):
            scores = per_term[term.name] = self._score(term, answer, completions, meta)
            for row, score in enumerate(scores):
                total[row] += term.weight * score
            self._sums[term.name] = self._sums.get(term.name, 0.0) + sum(scores)
            self._counts[term.name] = self._counts.get(term.name, 0) + len(scores)
        overflow = [row for row, value in enumerate(total) if not math.isfinite(value)]
        if overflow:  # finite terms whose weighted sum is not (1e308 * 2): never a reward of inf
            failure = TermFailure("overflowed: the weighted sum of the terms is not finite", overflow)
            if self.on_error == "fail":
                raise RewardError(self._describe(RewardTerm("sum", None), failure, completions, meta))
            self._errors["sum"] = self._errors.get("sum", 0) + len(overflow)
            total = [0.0 if row in set(overflow) else value for row, value in enumerate(total)]
        self._keep_samples(completions, meta, total, per_term)
        return total

    def _keep_samples(self, completions: Sequence[str], meta: dict[str, Any], total: list[float],
                      per_term: dict[str, list[float]]) -> None:
        wanted = min(self.samples - len(self._samples), len(completions))
        if wanted <= 0:
            return
        texts, answers = meta.get("text"), meta.get("answer")
        for row in sorted({index * len(completions) // wanted for index in range(wanted)}):  # evenly spread rows
            self._samples.append({"prompt": texts[row] if texts is not None else None, "completion": completions[row],
                                  "reward": total[row], "rewards": {name: scores[row] for name, scores in per_term.items()},
                                  "answer": answers[row] if answers is not None else None})

    def pop_samples(self) -> list[dict[str, Any]]:
        """The samples kept since the last call (call it before `pop_metrics`, which drops them)."""
        samples, self._samples = self._samples, []
        return samples

    def pop_metrics(self) -> dict[str, float]:
        """Each term's mean score, and the failed samples, since the last call."""
        out = {f"reward/{name}": self._sums[name] / count for name, count in self._counts.items() if count}
        out["reward/errors"] = float(sum(self._errors.values()))
        out.update({f"reward/{name}/errors": float(count) for name, count in self._errors.items()})
        everyone = [name for name, count in self._errors.items() if count and count == self._counts.get(name)]
        out.update({f"reward/{name}/all_failed": 1.0 for name in everyone})
        self.last_failures = {name: self._first_error[name] for name in everyone}
        self._sums, self._counts, self._errors, self._first_error, self._samples = {}, {}, {}, {}, []
        return out

    # -- one term -------------------------------------------------------------------------------
    def _answers(self, calls: Sequence[tuple[RewardTerm, Sequence[str], dict[str, Any]]]) -> list[list[float] | TermFailure]:
        """Each call's checked scores, or its failure: in the reward pool (concurrently), or here in turn."""
        if self.pool is None:
            return [self._in_process(*call) for call in calls]
        index = {id(term): position for position, term in enumerate(self.terms)}
        answers = self.pool.run([(index[id(term)], list(completions), meta) for term, completions, meta in calls],
                                self.timeout_s)
        return [answer["scores"] if "scores" in answer else
                TermFailure(answer["problem"], answer["rows"], answer["partial"], answer["raised"]) for answer in answers]

    def _score(self, term: RewardTerm, answer: list[float] | TermFailure, completions: Sequence[str],
               meta: dict[str, Any]) -> list[float]:
        """The term's scores, or for a failure what `on_error` says (a RewardError, or zeros counted)."""
        if not isinstance(answer, TermFailure):
            return answer
        failure = answer
        if self.on_error == "fail":
            if failure.raised:
                failure = self._blame(term, failure, completions, meta)
            raise RewardError(self._describe(term, failure, completions, meta)) from None
        self._errors[term.name] = self._errors.get(term.name, 0) + len(failure.rows)
        self._first_error.setdefault(term.name, self._describe(term, failure, completions, meta).splitlines()[0])
        return failure.partial if failure.partial is not None else [0.0] * len(completions)

    def _in_process(self, term: RewardTerm, completions: Sequence[str], meta: dict[str, Any]) -> list[float] | TermFailure:
        """`reward_workers: 0` (debugging): the term runs in this process; a timeout leaves it running in a thread."""
        if self.timeout_s is None:
            try:
                return run_term(term.fn, completions, meta)
            except TermFailure as failure:
                return failure
        if getattr(self, "_thread", None) is None:
            self._thread = _TermThread()
            weakref.finalize(self, self._thread.stop)  # no idle thread outlives its pipeline
        answer = self._thread.run(term.fn, completions, meta, self.timeout_s)
        if answer is None:  # the term goes on running in its thread, which then ends; the next call gets a new one
            self._thread.stop()
            self._thread = None
            return TermFailure(f"timed out after {self.timeout_s:g} s (reward_timeout_s; it goes on running in a "
                            "thread of the controller: reward_workers: 0)", list(range(len(completions))))
        return answer

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_thread": None}  # a thread does not pickle; the copy starts its own

    def _blame(self, term: RewardTerm, failure: TermFailure, completions: Sequence[str], meta: dict[str, Any]) -> TermFailure:
        """A batched call that raised says nothing of which sample made it raise: call the term on
        each sample alone (its per-row fields sliced alike) and blame those that raise, quoting the
        first one's own exception. Only on the way to a RewardError, so it costs nothing when rewards work."""
        n, rows, first = len(completions), [], None
        calls = [(term, [completions[row]], {key: value[row:row + 1] if isinstance(value, (list, tuple)) and len(value) == n
                                             else value for key, value in meta.items()}) for row in range(n)]
        # In the pool the samples run concurrently; in this process one by one, stopping at a timeout.
        answers = self._answers(calls) if self.pool is not None else (self._in_process(*call) for call in calls)
        for row, alone in enumerate(answers):
            if isinstance(alone, TermFailure):
                if not alone.raised:  # a timeout or a dead worker: keep what the batch said
                    return failure
                rows.append(row)
                first = first or alone
        if first is None:
            return TermFailure(f"{failure.problem} when called on all {n} samples together, though each sample alone "
                            "scores without error", [])
        return TermFailure(first.problem, rows)

    def _describe(self, term: RewardTerm, failure: TermFailure, completions: Sequence[str], meta: dict[str, Any]) -> str:
        if not failure.rows:  # the batch as a whole, no sample of it
            return (f"reward {term.name!r} {failure.problem}\n  fix: make the reward score each completion on its own "
                    f"(or set `reward_on_error: zero` to score such calls 0 and count them in reward/errors)")
        row = failure.rows[0]
        prompt = meta.get("text", [None] * len(completions))
        sample = f" on sample {row} of {len(completions)}"
        if row < len(completions):
            if prompt and row < len(prompt) and prompt[row] is not None:
                sample += f" (prompt {_short(prompt[row])}"
                sample += f", completion {_short(completions[row])})"
            else:
                sample += f" (completion {_short(completions[row])})"
        many = f"; {len(failure.rows)} samples affected" if len(failure.rows) > 1 and len(failure.rows) < len(completions) else ""
        return (f"reward {term.name!r} {failure.problem}{sample}{many}\n"
                f"  fix: make the reward return one finite float per completion, or set `reward_on_error: zero` to score "
                f"such samples 0 and count them in the metric reward/errors")


def _functions(functions: tuple[Callable[..., Any], ...]) -> tuple[Callable[..., Any], ...]:
    """The default recipe: the term functions themselves (pickled by reference)."""
    return functions


def _short(text: Any, limit: int = 80) -> str:
    text = str(text)
    return repr(text if len(text) <= limit else text[:limit] + "...")
