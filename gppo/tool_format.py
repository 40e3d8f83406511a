"""The text format of a Python tool call and its output (`--tools python`, `gppo.rollout.tools`):

    ```python
    print(347*829)
    ```
    ```output
    287663
    ```

A block closes with its ``` line's newline; the output block follows it directly. Stated once
here for the engines, which stop where a block closes, and for the tasks whose teachers write it
(`gppo.tasks.multiplication`).
"""

from __future__ import annotations

import re

_OPEN = re.compile(r"```(?:python|py)[ \t]*\n")
_CLOSE = re.compile(r"((?:(?!```).)*?)\n?```[ \t]*\n\s*", re.S)  # the code, then the closing line
FENCE = "```"


def closed_code_block(text: str) -> str | None:
    """The code of the last ```python block when `text` ends with the line that closes it (a
    ``` line, ended by its newline: until then "```python" may be a new opening), else None: a
    block already answered (an ```output block follows it) or still open is not pending."""
    opened = list(_OPEN.finditer(text))
    if not opened:
        return None
    closed = _CLOSE.fullmatch(text, opened[-1].end())
    return None if closed is None else closed.group(1)


def output_block(text: str) -> str:
    """The tool tokens' text: the output in an ```output block, after the closed ```python block."""
    return f"{FENCE}output\n{text.rstrip()}\n{FENCE}\n"
