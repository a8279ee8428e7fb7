"""docs/testing.md shows code that runs: every ```python block, top to bottom, in one namespace."""

import pathlib
import re


def test_every_code_block_of_docs_testing_runs():
    text = (pathlib.Path(__file__).parents[2] / "docs/testing.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 5
    namespace: dict = {}
    for index, block in enumerate(blocks):
        exec(compile(block, f"docs/testing.md block {index}", "exec"), namespace)
