"""Run directories that cannot be lost or mixed: the lock, resume overrides, restarts, atomic
checkpoints and final/, pruning, fallback from a corrupt checkpoint, a full disk, stale temporary
files, unstable training, and SIGKILL at random points. "Bit-identical" means the parameters
equal those of an uninterrupted run of the same configuration."""

import errno
import json
import math
import multiprocessing
import os
import random
import shutil
import signal
import sys
import time

import pytest
import torch
import yaml
from safetensors.torch import load_file

from gppo.cli import main
from gppo.trainer import ConfigError, RunError, Trainer
from gppo.trainer.checkpoint import (
    MANIFEST,
    NoSpaceError,
    RunLock,
    checkpoint_problem,
    is_no_space,
    latest_checkpoint,
    save_checkpoint,
    write_dir,
)
from gppo.trainer.config import from_dict
from gppo.trainer.logging import MetricsLog
from gppo.trainer.trainer import UnstableTrainingError
from tests.test_trainer import micro_config

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def steps_logged(run):
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def temps(run):
    return sorted(str(p.relative_to(run)) for p in run.rglob(".tmp-*"))


def weights(path):
    return load_file(path / "model.safetensors")


def assert_same_weights(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


@pytest.fixture(scope="module")
def reference(micro_model, tmp_path_factory):
    """final/ of an uninterrupted 3-step run of `micro_config`."""
    run = tmp_path_factory.mktemp("reference") / "run"
    Trainer(micro_config(micro_model, run)).train()
    return run / "final"


def interrupted(micro_model, run, after=2, **changes):
    assert Trainer(micro_config(micro_model, run, **changes)).train(stop_after=after) is None
    return run


# ------------------------------------------------------------------------------ lock
def _hold_lock(path, ready, release):
    lock = RunLock(path)
    ready.set()
    release.wait()
    lock.release()


def test_a_second_process_is_refused_with_the_holders_pid_and_a_dead_holder_does_not_block(
    micro_model, tmp_path, capsys
):
    run = tmp_path / "run"
    context = multiprocessing.get_context("fork")
    ready, release = context.Event(), context.Event()
    holder = context.Process(target=_hold_lock, args=(run, ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        with pytest.raises(RunError, match=f"in use by another gppo process \\(PID {holder.pid},"):
            Trainer(micro_config(micro_model, run))
        assert main(["train", "--model", str(micro_model), "--output_dir", str(run), "--progress", "false"]) == 2
        assert f"PID {holder.pid}" in capsys.readouterr().err
        assert not (run / "config.yaml").exists()  # the refused process wrote nothing
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.join()
    trainer = Trainer(micro_config(micro_model, run))  # the kernel dropped the dead holder's lock
    with pytest.raises(RunError, match=f"PID {os.getpid()},"):  # one Trainer per run, in a process too
        Trainer(micro_config(micro_model, run))
    trainer.close()
    with pytest.raises(RunError, match="has released.*Trainer.resume"):
        trainer.train()
    Trainer(micro_config(micro_model, run)).close()


def test_a_trainer_that_fails_to_start_releases_the_lock(micro_model, tmp_path):
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match="group_size"):
        Trainer(micro_config(micro_model, run, group_size=1))
    Trainer(micro_config(micro_model, run)).close()


# ------------------------------------------------------------------------------ resume
def test_overrides_given_with_resume_survive_the_next_interruption(micro_model, tmp_path, reference):
    run = interrupted(micro_model, tmp_path / "run", after=1, steps=2)
    resumed = Trainer.resume(run, {"steps": 3})
    assert resumed.train(stop_after=2) is None  # killed again before reaching the new step count
    assert yaml.safe_load((run / "config.yaml").read_text())["steps"] == 3
    again = Trainer.resume(run)
    assert (again.config.steps, again.step) == (3, 2)
    again.train()
    assert steps_logged(run) == [0, 1, 2, 3]
    assert_same_weights(run / "final", reference)

    changed = Trainer.resume(run, {"preset": "ripo", "steps": 4})
    changed.close()
    later = Trainer.resume(run)
    later.close()
    assert (later.config.preset, later.config.steps) == ("ripo", 4)


def test_restarting_a_run_without_checkpoint_starts_clean_and_keeps_the_old_attempt(micro_model, tmp_path, reference):
    run = interrupted(micro_model, tmp_path / "run", after=2, save_every=0)
    assert latest_checkpoint(run) is None and steps_logged(run) == [0, 1, 2]
    (run / "console.log").write_text("not the trainer's\n")
    with pytest.raises(ConfigError, match="no usable checkpoint to resume from.*without --resume"):
        Trainer.resume(run)
    Trainer(micro_config(micro_model, run)).train()
    assert steps_logged(run) == [0, 1, 2, 3]
    (aborted,) = (run / "aborted").iterdir()
    assert sorted(p.name for p in aborted.iterdir()) == ["config.yaml", "metrics.jsonl"]
    assert steps_logged(aborted) == [0, 1, 2]
    assert (run / "console.log").read_text() == "not the trainer's\n"
    assert_same_weights(run / "final", reference)


# ------------------------------------------------------------------------------ atomic writes
def test_checkpoints_carry_a_manifest_and_final_is_replaced_whole(micro_model, tmp_path, monkeypatch):
    run = tmp_path / "run"
    trainer = Trainer(micro_config(micro_model, run, steps=2))
    trainer.train()
    checkpoint = run / "checkpoints" / "step_000002"
    sizes = json.loads((checkpoint / MANIFEST).read_text())["files"]
    assert {"model.safetensors", "config.json", "tokenizer.json", "trainer_state.pt"} <= set(sizes)
    assert all((checkpoint / name).stat().st_size == size for name, size in sizes.items())
    (tmp_path / "plain_dir").mkdir()
    (tmp_path / "plain_file").write_text("")
    for made, plain in ((run / "final", "plain_dir"), (checkpoint, "plain_dir"), (run / "config.yaml", "plain_file")):
        assert made.stat().st_mode == (tmp_path / plain).stat().st_mode, made  # not mkdtemp's 0700 / mkstemp's 0600
    before = weights(run / "final")

    resumed = Trainer.resume(run, {"steps": 3})
    saved = resumed.save

    def broken(path, *args, **kwargs):
        (path / "tokenizer.json").write_text("{")
        raise RuntimeError("killed while writing the tokenizer")

    def save():  # the step-3 checkpoint is written whole, then final/ fails half-way
        checkpoint = saved()
        monkeypatch.setattr(resumed.tokenizer, "save_pretrained", broken)
        return checkpoint

    monkeypatch.setattr(resumed, "save", save)
    with pytest.raises(RuntimeError, match="killed while writing"):
        resumed.train()
    assert temps(run) == []
    for key, value in weights(run / "final").items():  # final/ is still the whole step-2 model
        assert torch.equal(value, before[key])
    assert json.loads((run / "final" / "tokenizer.json").read_text())
    monkeypatch.undo()
    Trainer.resume(run).train()  # the step-3 checkpoint was written: resuming writes final/ again
    assert (run / "final" / "tokenizer.json").is_file() and temps(run) == []


def test_every_file_and_folder_is_fsynced_before_latest_moves(micro_model, tmp_path, monkeypatch):
    from gppo.models.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(micro_model)
    events, fsync, replace = [], os.fsync, os.replace

    def recording_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recording_replace(src, dst):
        events.append(("replace", str(dst)))
        replace(src, dst)

    monkeypatch.setattr("gppo.trainer.checkpoint.os.fsync", recording_fsync)
    monkeypatch.setattr("gppo.trainer.checkpoint.os.replace", recording_replace)
    run = tmp_path / "run"
    save_checkpoint(run, 1, model, tokenizer, {}, keep=2)
    monkeypatch.undo()
    root = run / "checkpoints"
    pointer = events.index(("replace", str(root / "latest")))
    renamed = events.index(("replace", str(root / "step_000001")))
    synced = [path for kind, path in events[:renamed] if kind == "fsync"]
    temp = os.path.commonpath(synced)  # the temporary folder the checkpoint was written in
    assert sorted(os.path.relpath(p, temp) for p in synced if p != temp) == sorted(
        p.name for p in (root / "step_000001").iterdir()
    )
    assert temp in synced and ("fsync", str(root)) in events[renamed:pointer]  # the folder, then its rename
    assert events[pointer - 1][0] == "fsync"  # the pointer's own content


def test_a_failed_rename_puts_the_previous_directory_back(tmp_path, monkeypatch):
    target = tmp_path / "final"
    write_dir(target, lambda tmp: (tmp / "a").write_text("old"))
    replace = os.replace

    def failing(src, dst):
        if str(src).startswith(str(tmp_path / ".tmp-final-")):
            raise OSError(errno.EIO, "Input/output error")
        replace(src, dst)

    monkeypatch.setattr("gppo.trainer.checkpoint.os.replace", failing)
    with pytest.raises(OSError, match="Input/output error"):
        write_dir(target, lambda tmp: (tmp / "a").write_text("new"))
    assert (target / "a").read_text() == "old" and temps(tmp_path) == []


def test_pruning_keeps_the_new_checkpoint_and_drops_abandoned_newer_ones(micro_model, tmp_path):
    from gppo.models.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(micro_model)
    run = tmp_path / "run"
    root = run / "checkpoints"
    for step in (1, 2, 3):
        save_checkpoint(run, step, model, tokenizer, {}, keep=0)
    shutil.copytree(root / "step_000003", root / "step_000009")  # a continuation that was abandoned
    save_checkpoint(run, 4, model, tokenizer, {}, keep=1)
    assert (root / "latest").read_text() == "step_000004"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000004"]
    save_checkpoint(run, 5, model, tokenizer, {}, keep=3)
    save_checkpoint(run, 6, model, tokenizer, {}, keep=3)
    save_checkpoint(run, 7, model, tokenizer, {}, keep=3)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000005", "step_000006", "step_000007"]
    save_checkpoint(run, 2, model, tokenizer, {}, keep=3)  # resumed from an older state: newer ones go
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000002"]


# ------------------------------------------------------------------------------ corrupt checkpoints
def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garble(path):  # same size, not a zip any more
    path.write_bytes(b"\0" * path.stat().st_size)


def _bad_json(path):  # same size, not JSON any more
    text = path.read_text()
    path.write_text("}" + text[1:])


@pytest.mark.parametrize(
    "name,damage,problem",
    [
        ("model.safetensors", _truncate, "model.safetensors has .* bytes instead of"),
        ("tokenizer.json", os.remove, "tokenizer.json is missing"),
        ("config.json", _bad_json, "config.json is not valid JSON"),
        ("trainer_state.pt", _garble, "trainer_state.pt does not load"),
        (MANIFEST, os.remove, "its manifest.json is missing"),
    ],
)
def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(
    micro_model, tmp_path, reference, name, damage, problem
):
    run = interrupted(micro_model, tmp_path / "run", after=2)
    damage(run / "checkpoints" / "step_000002" / name)
    with pytest.warns(RuntimeWarning, match=f"step_000002: {problem}.*falling back to step_000001"):
        resumed = Trainer.resume(run)
    assert resumed.step == 1 and steps_logged(run) == [0, 1]
    resumed.train()
    assert_same_weights(run / "final", reference)


def test_no_usable_checkpoint_is_refused_on_resume(micro_model, tmp_path):
    run = interrupted(micro_model, tmp_path / "run", after=2)
    for step in (1, 2):
        (run / "checkpoints" / f"step_{step:06d}" / "config.json").unlink()
    assert checkpoint_problem(run / "checkpoints" / "step_000001") == "config.json is missing"
    with (
        pytest.warns(RuntimeWarning, match="no usable checkpoint"),
        pytest.raises(ConfigError, match="no usable checkpoint to resume from"),
    ):
        Trainer.resume(run)


# ------------------------------------------------------------------------------ full disk
def _enospc_in_tokenizer(trainer, monkeypatch):
    def full(path, *args, **kwargs):
        (path / "tokenizer.json").write_text('{"partial')
        raise ENOSPC

    monkeypatch.setattr(trainer.tokenizer, "save_pretrained", full)


def _enospc_in_torch_save(trainer, monkeypatch):
    def full(obj, f, *args, **kwargs):  # what torch.save raises when the file object's write fails
        f.write(b"PK\3\4partial")
        try:
            raise ENOSPC
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # noqa: B904 (as torch raises it)

    monkeypatch.setattr("gppo.trainer.checkpoint.torch.save", full)


def _enospc_in_safetensors(trainer, monkeypatch):
    class SafetensorError(Exception):
        pass

    def full(path, *args, **kwargs):
        (path / "model.safetensors").write_bytes(b"\0" * 100)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(trainer.model, "save_pretrained", full)


@pytest.mark.parametrize("fill", [_enospc_in_tokenizer, _enospc_in_torch_save, _enospc_in_safetensors])
def test_a_full_disk_is_a_clear_error_that_keeps_the_last_good_checkpoint(
    micro_model, tmp_path, reference, monkeypatch, fill
):
    run = tmp_path / "run"
    trainer = Trainer(micro_config(micro_model, run))
    saved = trainer.save

    def save():
        if trainer.step == 2:
            fill(trainer, monkeypatch)
        return saved()

    monkeypatch.setattr(trainer, "save", save)
    with pytest.raises(
        NoSpaceError,
        match="no space left on device at .*step_000002; the last good checkpoint "
        ".*step_000001 is intact: free some space",
    ):
        trainer.train()
    monkeypatch.undo()
    assert temps(run) == []
    assert (run / "checkpoints" / "latest").read_text() == "step_000001"
    assert checkpoint_problem(run / "checkpoints" / "step_000001") is None
    resumed = Trainer.resume(run)
    assert resumed.step == 1
    resumed.train()
    assert_same_weights(run / "final", reference)


def test_no_space_is_recognised_through_wrappers_and_reported_by_the_cli(micro_model, tmp_path, monkeypatch, capsys):
    assert is_no_space(ENOSPC) and is_no_space(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)))
    try:
        try:
            raise ENOSPC
        except OSError:
            raise RuntimeError("basic_ios::clear: iostream error")  # noqa: B904 (as torch raises it)
    except RuntimeError as wrapped:
        assert is_no_space(wrapped)
    assert not is_no_space(OSError(errno.EACCES, "Permission denied")) and not is_no_space(RuntimeError("x"))

    def full(*args, **kwargs):
        raise ENOSPC

    log = MetricsLog(tmp_path / "metrics.jsonl", [], {})
    monkeypatch.setattr("gppo.trainer.logging.os.fsync", full)
    with pytest.raises(NoSpaceError, match=f"no space left on device at {tmp_path / 'metrics.jsonl'}"):
        log.write(1, {"a": 1.0})
    monkeypatch.undo()
    monkeypatch.setattr("gppo.trainer.checkpoint.torch.save", full)
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--model",
                str(micro_model),
                "--output_dir",
                str(run),
                "--steps",
                "1",
                "--prompts_per_step",
                "2",
                "--group_size",
                "2",
                "--max_new_tokens",
                "4",
                "--eval_size",
                "4",
                "--eval_samples",
                "1",
                "--progress",
                "false",
                "--threads",
                "1",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "gppo train: error: no space left on device at" in err and "no checkpoint was written yet" in err
    assert "Traceback" not in err and temps(run) == []


# ------------------------------------------------------------------------------ stale temporary files
def test_stale_temporary_files_of_a_killed_run_are_removed_at_start(micro_model, tmp_path, reference):
    run = interrupted(micro_model, tmp_path / "run", after=2)
    (run / "checkpoints" / ".tmp-step_000003-x1").mkdir()
    (run / "checkpoints" / ".tmp-step_000003-x1" / "model.safetensors").write_bytes(b"half")
    (run / "checkpoints" / ".tmp-latest-x2").write_text("step_000003")
    (run / ".tmp-final-x3").mkdir()
    (run / ".tmp-config.yaml-x4").write_text("steps: 1")
    resumed = Trainer.resume(run)
    assert temps(run) == []
    resumed.train()
    assert_same_weights(run / "final", reference)


# ------------------------------------------------------------------------------ unstable training
def _poison_gradients(model, when, factor):
    """Multiply every gradient by `factor` while `when()` holds: a divergence made on purpose, so
    that the tests do not hinge on how one library version's numerics fail."""
    for p in model.parameters():
        p.register_hook(lambda g: g * factor if when() else g)


def embedded_config(run, **changes):
    """`micro_config`'s sizes on the embedded addition model, whose groups have varied rewards from
    the first step on (the untrained micro model's rewards are mostly all 0: no update)."""
    return from_dict({**micro_config("unused", run, **{"lr": 1e-4, **changes}).to_dict(), "model": None})


def test_a_nan_gradient_stops_the_run_naming_the_step_the_metric_and_the_last_good_checkpoint(tmp_path):
    run = tmp_path / "run"
    trainer = Trainer(embedded_config(run, steps=4))
    _poison_gradients(trainer.model, when=lambda: trainer.step == 1, factor=math.nan)  # in step 2's update
    with pytest.raises(
        UnstableTrainingError,
        match=f"step 2: optim/grad_norm is nan, so training stopped before "
        f"applying that update .*last good checkpoint is "
        f"{run / 'checkpoints' / 'step_000001'}: resume from it with a "
        f"lower learning rate, e.g. `gppo train --resume {run} --lr "
        f"1e-05`",
    ):
        trainer.train()
    assert all(p.isfinite().all() for p in trainer.model.parameters())  # the NaN update was not applied
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["step"] == 2 and json.loads(lines[-1])["optim/grad_norm"] == "nan"
    assert math.isnan(MetricsLog(run / "metrics.jsonl", [], {}).read()[-1]["optim/grad_norm"])
    assert (run / "checkpoints" / "latest").read_text() == "step_000001" and not (run / "final").exists()
    Trainer.resume(run, {"lr": 1e-5}).close()  # and the run continues from there


def test_an_exploding_update_stops_the_run_before_it_is_saved(tmp_path):
    """lr 1e6: AdamW's first step moves every weight by about 1e6, whatever the gradients' size, so the
    weight norm grows by orders of magnitude while loss and gradients may stay finite."""
    run = tmp_path / "run"
    trainer = Trainer(embedded_config(run, lr=1e6, epochs=1, mini_batch_size=16, steps=3))
    before = trainer.weight_norm
    with pytest.raises(
        UnstableTrainingError,
        match=r"step 1: optim/weight_norm went from \S+ to \S+ in one update "
        r"\(more than 10x: the update exploded\), so training stopped "
        r"without saving it .*no checkpoint was written yet: start the "
        r"run again with a lower learning rate \(e.g. --lr 100000\)",
    ):
        trainer.train()
    assert not trainer.weight_norm <= 10 * before
    assert not (run / "checkpoints" / "latest").exists() and not (run / "final").exists()
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 1


def test_gradients_stuck_at_zero_stop_the_run_after_three_steps(tmp_path):
    """Saturated log-probs give a gradient of exactly 0 with non-zero advantages (what lr 1e6 gave
    with transformers 5.24): reported after three such steps in a row, the checkpoints kept."""
    run = tmp_path / "run"
    trainer = Trainer(embedded_config(run, steps=6, eval_every=0))
    _poison_gradients(trainer.model, when=lambda: trainer.step >= 1, factor=0.0)
    with pytest.raises(
        UnstableTrainingError,
        match=f"step 4: optim/grad_norm was exactly 0 in every update of the "
        f"last 3 steps although the advantages were not 0.*last good "
        f"checkpoint is {run / 'checkpoints' / 'step_000003'}",
    ):
        trainer.train()
    grad_norms = [r.get("optim/grad_norm") for r in MetricsLog(run / "metrics.jsonl", [], {}).read()]
    assert grad_norms[1] > 0 and grad_norms[2:] == [0.0, 0.0, 0.0]


def test_zero_gradient_steps_between_healthy_ones_are_not_an_error(tmp_path):
    run = tmp_path / "run"
    trainer = Trainer(embedded_config(run, steps=5, eval_every=0))
    _poison_gradients(trainer.model, when=lambda: trainer.step in (0, 1, 3), factor=0.0)
    trainer.train()
    grad_norms = [r.get("optim/grad_norm") for r in MetricsLog(run / "metrics.jsonl", [], {}).read()]
    assert grad_norms[1:] == [0.0, 0.0, grad_norms[3], 0.0, grad_norms[5]] and grad_norms[3] > 0 < grad_norms[5]
    assert trainer.step == 5 and trainer.zero_gradient_steps == 0


def test_metrics_record_non_finite_values_as_strings_and_read_them_back(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl", [], {})
    log.write(3, {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "x": 0.5, "n": 2})
    raw = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert {k: raw[k] for k in ("nan", "inf", "-inf", "x", "n")} == {
        "nan": "nan",
        "inf": "inf",
        "-inf": "-inf",
        "x": 0.5,
        "n": 2,
    }
    (record,) = log.read()
    assert math.isnan(record["nan"]) and record["inf"] == math.inf and record["-inf"] == -math.inf
    assert record["step"] == 3 and record["x"] == 0.5


# ------------------------------------------------------------------------------ SIGTERM
def _cli_in_child(argv, log):
    """`gppo ARGV` in a forked child, its stdout and stderr in the file `log`."""
    with open(log, "w") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
        sys.exit(main(argv))


def _terminate_after_first_checkpoint(argv, run_glob, tmp_path):
    """Start `gppo ARGV`, SIGTERM it once a checkpoint matching `run_glob` exists; (exit code, log)."""
    log = tmp_path / "log"
    child = multiprocessing.get_context("fork").Process(target=_cli_in_child, args=(argv, log))
    child.start()
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(run_glob)) and child.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert child.is_alive(), log.read_text()
    os.kill(child.pid, signal.SIGTERM)
    child.join(120)
    return child.exitcode, log.read_text()


def test_sigterm_stops_train_like_ctrl_c_with_exit_143_and_a_resumable_checkpoint(micro_model, tmp_path):
    run = tmp_path / "run"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(micro_config(micro_model, run, steps=200).to_dict()))
    code, log = _terminate_after_first_checkpoint(
        ["train", "--config", str(config)], "run/checkpoints/latest", tmp_path
    )
    assert code == 143, log
    log = " ".join(log.split())  # rich wraps long lines when not writing to a terminal
    latest = latest_checkpoint(run)
    assert latest is not None and checkpoint_problem(latest) is None  # whole, and named in the message
    assert f"continue from {latest.name} with `gppo train --resume {run}`" in log, log
    assert "gppo train: stopped by SIGTERM" in log and "Traceback" not in log
    step = int(latest.name.split("_")[1])
    Trainer.resume(run, {"steps": step + 1}).train()  # and it continues from there
    assert steps_logged(run)[-1] == step + 1


def test_sigterm_stops_a_sweep_saying_how_to_continue(micro_model, tmp_path):
    argv = [
        "sweep",
        "--model",
        str(micro_model),
        "--out",
        str(tmp_path / "sweep"),
        "--workers",
        "1",
        "--presets",
        "grpo",
        "--seeds",
        "0",
        "--steps",
        "200",
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
        "--save_every",
        "1",
        "--mini_batch_size",
        "16",
        "--micro_batch_size",
        "16",
        "--threads",
        "1",
    ]
    code, log = _terminate_after_first_checkpoint(argv, "sweep/*/checkpoints/latest", tmp_path)
    assert code == 143, log
    assert "gppo sweep: stopped by SIGTERM; run the same command again to continue" in log


# ------------------------------------------------------------------------------ SIGKILL
def _train_in_child(config):
    Trainer(config).train()


def test_runs_killed_at_random_points_resume_bit_identical(micro_model, tmp_path, reference):
    """SIGKILL a training process at random moments after its first checkpoint (during rollouts,
    updates, checkpoint writes, final/), twice, then resume: the end is the uninterrupted run's."""
    rng = random.Random(12)
    run = tmp_path / "run"
    context = multiprocessing.get_context("fork")  # the child inherits the imports: no start-up cost
    kills = 0
    while kills < 2:
        config = micro_config(micro_model, run) if kills == 0 else None
        child = context.Process(target=_train_in_child if config else _resume_in_child, args=(config or run,))
        child.start()
        first = time.monotonic()
        while not (run / "checkpoints" / "latest").exists() and child.is_alive() and time.monotonic() - first < 60:
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.4))
        if not child.is_alive():
            break
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        kills += 1
    child.join()
    if not (run / "summary.json").exists():
        Trainer.resume(run).train()
    assert steps_logged(run) == [0, 1, 2, 3]
    assert_same_weights(run / "final", reference)


def _resume_in_child(run):
    Trainer.resume(run).train()
