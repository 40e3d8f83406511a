"""The text format of a Python tool call and its output (`--tools python`, `gppo.rollout.tools`):

    ```python
    print(347*829)
    ```
    ```output
    287663
    ```

A block closes with a line that is exactly ``` and its newline; the output block follows it
directly. Stated once here for the engines and for the tasks whose teachers write it
(`gppo.tasks.multiplication`). vLLM stops a segment at every `STOP_STRINGS` occurrence (ToolEngine
resumes one that closed no ```python block), the HF engine only where `closed_code_block` finds a
closed block: the same calls, at the same tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FENCE = "```"
# What ends a closing line. A sampled segment ends at the first occurrence of one (vLLM's stop
# strings); each starts with FENCE, which a block's code cannot hold, so the first one after an
# opening line is the line that closes it.
STOP_STRINGS = (f"{FENCE}\n",)
_OPEN = re.compile(r"```(?:python|py)[ \t]*\n")
# the code (no fence in it), then the closing line; after it only the rest of the token that wrote
# its newline, if that is whitespace
_CLOSE = re.compile(rf"((?:(?!```).)*?)\n?(?:{'|'.join(map(re.escape, STOP_STRINGS))})\s*", re.S)


def closed_code_block(text: str) -> str | None:
    """The code of the last ```python block when `text` ends with the line that closes it (until its
    newline, "```python" may still be a new opening), else None: a block already answered (an
    output follows it) or still open is not pending, and neither is one closed by "``` " or "```\\t"
    (no stop string ends there, so vLLM would sample on)."""
    opened = list(_OPEN.finditer(text))
    if not opened:
        return None
    closed = _CLOSE.fullmatch(text, opened[-1].end())
    return None if closed is None else closed.group(1)


@dataclass(frozen=True)
class ToolTurn:
    """The text around a tool's output in a completion: `before` + output + `after`. The engine
    tokenizes the two as they are (a chat template's role markers are special tokens) and the
    output as plain text."""

    before: str
    after: str

    def __call__(self, output: str) -> str:
        """The whole answer's text, the output without its trailing whitespace."""
        return f"{self.before}{output.rstrip()}{self.after}"


output_block = ToolTurn(f"{FENCE}output\n", f"\n{FENCE}\n")  # the fenced output block: output_block("42")
