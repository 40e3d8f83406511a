"""What `gppo train` tells its user (issue 19): held-out accuracy with standard errors and the
problems each evaluation used, the run directory's size and what fills it, one uncut plain line
per step when the output is piped, and markers on sparse curves."""

import json
import math

from gppo.cli import main
from gppo.trainer.logging import accuracy_summary, curve_marker

RUN = [
    "--steps",
    "2",
    "--prompts_per_step",
    "4",
    "--group_size",
    "4",
    "--max_new_tokens",
    "6",
    "--eval_size",
    "8",
    "--eval_samples",
    "2",
    "--eval_every",
    "0",
    "--mini_batch_size",
    "16",
    "--micro_batch_size",
    "16",
    "--save_every",
    "1",
    "--lr",
    "1e-3",
    "--threads",
    "1",
]


def test_piped_run_prints_steps_accuracy_with_errors_and_storage(micro_model, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", "--model", str(micro_model), "--output_dir", str(run_dir), *RUN]) == 0
    out = capsys.readouterr().out
    steps = [line for line in out.splitlines() if line.startswith("step ") and "/2 |" in line]
    assert [line.split()[1] for line in steps] == ["1/2", "2/2"] and all("elapsed" in line for line in steps)
    summary = next(line for line in out.splitlines() if line.startswith("held-out accuracy"))
    assert summary.count("(8 problems)") == 2 and "greedy change" in summary and " ± " in summary
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    greedy, se = first["eval/greedy"], first["eval/greedy_se"]
    assert math.isclose(se, math.sqrt(greedy * (1 - greedy) * 8 / 7 / 8))  # sample SD of 0/1 scores over sqrt(8)
    storage = next(line for line in out.splitlines() if line.startswith("run directory:"))
    assert " GB, of which " in storage and "optimizer state" in storage and "checkpoints/ can be deleted" in storage

    # resumed with another --eval_size: the "before" numbers keep their own problem count
    assert main(["train", "--resume", str(run_dir), "--steps", "3", "--eval_size", "4"]) == 0
    summary = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("held-out accuracy"))
    assert "(8 problems)  ->  after 3 steps" in summary and "(4 problems); not comparable" in summary


def test_summary_without_errors_or_sizes_reads_old_metrics():
    old = {"eval/greedy": 0.25, "eval/avg@k": 0.5}  # metrics.jsonl written before standard errors were logged
    text = accuracy_summary(old, {"eval/greedy": 0.5, "eval/avg@k": 0.75}, 4, 2)
    assert text == (
        "held-out accuracy before RL: greedy 0.250, sampled avg@2 0.500  ->  after 4 steps: greedy 0.500, "
        "sampled avg@2 0.750"
    )


def test_sparse_curves_get_markers():
    assert curve_marker(16, 301) == "o"  # held-out accuracy every 20 steps of a 300-step run
    assert curve_marker(5, 5) == "o"  # a short run
    assert curve_marker(300, 301) is None  # a per-step curve
