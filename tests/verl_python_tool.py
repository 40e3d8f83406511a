"""A Python interpreter as a verl function tool (`rollout.multi_turn.function_tool_path`), for the
multi-turn top-K test of tests/test_verl_topk.py and the verl-tools row of benchmarks/gpu_check.sh:
the model's code runs in gppo's sandbox (gppo.rewards.code.run_program), and what it printed, or why
it failed, is the tool message."""

from __future__ import annotations

from verl.tools.function_tool import function_tool

from gppo.rewards.code import CaseStatus, run_program


@function_tool
def python(code: str) -> str:
    """Run a Python program and return what it printed.

    Args:
        code: The program's source code.
    """
    run = run_program(code)
    if run.status == CaseStatus.PASSED:
        return run.stdout
    return f"{run.status.value}: {run.detail}\n{run.stderr}".strip()
