"""Render a plan's Graphviz source (`Plan.to_dot()`, written by the plan itself like its text) to an
image with Graphviz's `dot`, where it is installed."""

from __future__ import annotations


def render(dot_source: str, path: str) -> str | None:
    """Write `path` (.svg/.png) with Graphviz's `dot` if it is installed; returns the path or None."""
    import shutil
    import subprocess

    if shutil.which("dot") is None:
        return None
    fmt = path.rsplit(".", 1)[-1]
    subprocess.run(["dot", f"-T{fmt}", "-o", path], input=dot_source.encode(), check=True)
    return path
