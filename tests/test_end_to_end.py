"""End to end on the shipped warm start (slow: about a minute; `-m "not slow"` skips it)."""

import json

import pytest

from gppo.cli import main

pytestmark = pytest.mark.slow


def test_default_run_improves_held_out_accuracy_and_eval_reads_the_result(tmp_path, capsys):
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--output_dir",
                str(run),
                "--steps",
                "20",
                "--eval_every",
                "0",
                "--eval_size",
                "256",
                "--progress",
                "false",
            ]
        )
        == 0
    )
    summary = json.loads((run / "summary.json").read_text())
    before, after = summary["before"], summary["after"]
    assert after["eval/greedy"] > before["eval/greedy"] + 0.3
    assert after["eval/avg@k"] > before["eval/avg@k"] + 0.2
    assert "(256 problems)  ->  after 20 steps:" in capsys.readouterr().out
    assert main(["eval", "--model", str(run / "final"), "--task", "addition", "--eval_size", "256"]) == 0
    printed = dict(line.split() for line in capsys.readouterr().out.strip().splitlines())
    assert float(printed["eval/greedy"]) == pytest.approx(after["eval/greedy"], abs=1e-4)  # printed to 4 places
