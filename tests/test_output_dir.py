"""The run's output folder: refused at start when it cannot be used, and written by one run at a time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from conftest import ROOT, file_size_limit
from specforge_lite.training.output_dir import OutputDirError, hold_output_dir

HOLD = ("import sys, time; from specforge_lite.training.output_dir import hold_output_dir\n"
        "with hold_output_dir(sys.argv[1]):\n    print('holding', flush=True); time.sleep(600)")


def test_a_second_run_on_a_held_folder_names_the_holder_and_a_kill_9_frees_it(tmp_path):
    """Two runs on one output folder would prune each other's checkpoints: the second is refused naming the
    first (its pid), before anything is built; the kernel drops the hold when the holder dies, even by
    kill -9, so the lock file left behind blocks nobody."""
    folder = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(OutputDirError, match=f"being written by another run .pid {holder.pid} on "):
            with hold_output_dir(folder):
                pass
        from specforge_lite.compose import load_config
        from specforge_lite.job import run

        with pytest.raises(OutputDirError, match=f"pid {holder.pid}"):
            run(load_config(["model=llama3_tiny", "tracker=none"]), folder, log=lambda m: None)
        assert not (folder / "config.yaml").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (folder / ".lock").is_file()
    with hold_output_dir(folder):  # free again at once
        with pytest.raises(OutputDirError, match=f"pid {os.getpid()} on "):  # and held by us now
            with hold_output_dir(folder):
                pass


def test_an_output_dir_that_is_a_file_is_refused_before_anything_runs(tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("not a folder")
    proc = subprocess.run([sys.executable, "train.py", "model=llama3_tiny", "tracker=none", f"output_dir={taken}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"error: output_dir={taken} is a file, not a folder"), proc.stderr
    assert taken.read_text() == "not a folder"


def test_a_write_refused_by_the_machine_anywhere_is_one_line_with_the_fix(tmp_path):
    """A full disk (here a file-size limit, failing the same way) can meet any small file of a run (its
    config, data statistics, evaluation): every tool stops with one ``error:`` line saying what to do, not
    a traceback."""
    from specforge_lite.errors import said_in_one_line

    with pytest.raises(SystemExit) as stop, said_in_one_line(), file_size_limit(100):
        (tmp_path / "data_stats.json").write_text("x" * 1000)
    said = str(stop.value.code)
    assert said.startswith("error: ") and "could not be written (File too large)" in said
    assert "run the same command" in said and "Traceback" not in said


@pytest.fixture
def read_only_disk(tmp_path):
    """A real read-only file system (a tmpfs mounted ro): even root cannot write it. Mounting needs the
    privilege to mount; without it the test says so and is skipped."""
    folder = tmp_path / "ro"
    folder.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)],
                                 capture_output=True, text=True)
    except FileNotFoundError:  # (no mount command at all)
        pytest.skip("cannot mount a read-only tmpfs here (no mount command)")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here ({mounted.stderr.strip() or mounted.returncode})")
    yield folder
    subprocess.run(["umount", str(folder)], capture_output=True)


def test_an_output_dir_on_a_read_only_disk_is_refused_before_anything_runs(read_only_disk):
    run_dir = read_only_disk / "run"
    proc = subprocess.run([sys.executable, "train.py", "model=llama3_tiny", "tracker=none", f"output_dir={run_dir}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"error: output_dir={run_dir} cannot be created: {read_only_disk} is not "
                                  "writable"), proc.stderr
