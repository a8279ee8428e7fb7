"""Environments for tests/agents/test_workers.py, at module level so that worker processes import them."""

import os
import signal
import time

import rlgraph as rg


class Countdown(rg.Env):
    """Three turns; answers with a fixed text of digits; the reward counts the '1's the policy wrote."""

    def reset(self, row):
        self.turn, self.ones = 0, 0

    def step(self, text):
        assert isinstance(text, str), f"a text env's action is text, got {type(text).__name__}"
        self.turn += 1
        self.ones += text.count("1")
        return rg.Step("12" * self.turn, reward=float(self.ones), done=self.turn >= 3, info={"tool_calls": 1})


class CountTokens:
    """A token env of two turns: its observation is the action's first id twice, the reward the action's length."""

    def initial_observation(self, row):
        self.turn = 0
        return [5]

    def step(self, action_tokens):
        self.turn += 1
        return rg.Step(action_tokens[:1] * 2, reward=float(len(action_tokens)), done=self.turn >= 2)


class Accidents(Countdown):
    """Countdown, but on its second turn the episode of prompt '14+94=' hangs and that of '83+63='
    kills its own worker process."""

    def reset(self, row):
        super().reset(row)
        self.text = row["text"]

    def step(self, text):
        if self.turn == 1 and self.text == "14+94=":
            time.sleep(600)
        if self.turn == 1 and self.text == "83+63=":
            os.kill(os.getpid(), signal.SIGKILL)
        return super().step(text)


class Raises(Countdown):
    def step(self, text):
        raise ValueError("no such move")


class WrongType(Countdown):
    def step(self, text):
        return "a step"


def broken_recipe():
    raise ImportError("no module named my_envs")


class Floods(Countdown):
    """Countdown, but on its second turn the episode of prompt '14+94=' answers a NaN reward and that
    of '83+63=' a 20 MB observation (issue 34, items 14-15)."""

    def reset(self, row):
        super().reset(row)
        self.text = row["text"]

    def step(self, text):
        step = super().step(text)
        if self.turn == 2 and self.text == "14+94=":
            return rg.Step("ok", reward=float("nan"))
        if self.turn == 2 and self.text == "83+63=":
            return rg.Step("x" * 20_000_000, reward=1.0)
        return step
