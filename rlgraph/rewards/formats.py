"""Format rewards: 1.0 when a completion has the asked-for shape, else 0.0.

    FormatRegex(pattern=r"\\d+$")                 a regular expression (search, match or fullmatch)
    Tags(tags=["think", "answer"], strict=True)   <think>...</think><answer>...</answer>, in order

Both check their options when built (a bad pattern is a ConfigError naming it) and are plain
picklable objects, so a reward role can be shipped to another process.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal

from rlgraph.errors import ConfigError

_FLAGS = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE}


class FormatRegex:
    """1.0 where `pattern` is found in the completion (`mode`: search, match at the start, or fullmatch)."""

    def __init__(self, pattern: str, mode: Literal["search", "match", "fullmatch"] = "search", flags: str = ""):
        if mode not in ("search", "match", "fullmatch"):
            raise ConfigError(f"format_regex: mode {mode!r} is not one of search, match, fullmatch")
        unknown = sorted(set(flags) - set(_FLAGS))
        if unknown:
            raise ConfigError(f"format_regex: flags {flags!r} has unknown letter(s) {''.join(unknown)!r}",
                              fix="use any of i (ignore case), m (multiline), s (dot matches newline), x (verbose)")
        if not isinstance(pattern, str):
            raise ConfigError(f"format_regex: pattern must be a string, got {type(pattern).__name__} {pattern!r}")
        try:
            self.regex = re.compile(pattern, sum((_FLAGS[f] for f in set(flags)), 0))
        except re.error as exc:
            raise ConfigError(f"format_regex: pattern {pattern!r} is not a valid regular expression: {exc}",
                              fix="check the escaping: in YAML, write the pattern in single quotes, e.g. '\\d+$'") from None
        self.mode = mode

    def __call__(self, completions: Sequence[str], **_: Any) -> list[float]:
        find = getattr(self.regex, self.mode)
        return [float(find(text) is not None) for text in completions]

    def __repr__(self) -> str:
        return f"FormatRegex({self.regex.pattern!r}, mode={self.mode!r})"


class Tags:
    """1.0 where each of `tags` appears exactly once as `<tag>...</tag>` with non-empty content, in
    the given order; with `strict`, nothing but whitespace may lie outside the tags."""

    def __init__(self, tags: Sequence[str] = ("think", "answer"), strict: bool = False):
        if isinstance(tags, str) or not tags or not all(isinstance(t, str) and re.fullmatch(r"[\w.-]+", t) for t in tags):
            raise ConfigError(f"tags: {tags!r} is not a list of tag names", fix="write e.g. tags: [think, answer]")
        if len(set(tags)) != len(tags):
            raise ConfigError(f"tags: {list(tags)!r} names a tag twice")
        self.tags, self.strict = list(tags), bool(strict)
        body = r"\s*".join(rf"<{re.escape(t)}>(?P<t{i}>.*?)</{re.escape(t)}>" for i, t in enumerate(self.tags))
        self.regex = re.compile(rf"^\s*{body}\s*$" if self.strict else body, re.DOTALL)

    def __call__(self, completions: Sequence[str], **_: Any) -> list[float]:
        return [float(self._ok(text)) for text in completions]

    def _ok(self, text: str) -> bool:
        if any(text.count(f"<{t}>") != 1 or text.count(f"</{t}>") != 1 for t in self.tags):
            return False
        match = self.regex.search(text)
        return match is not None and all(group.strip() for group in match.groups())

    def __repr__(self) -> str:
        return f"Tags({self.tags!r}, strict={self.strict})"
