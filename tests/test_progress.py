"""The tools' progress bar: drawn on a terminal, silent in a log, lines printed above it; the
tools that do long work (dcp-simulate over policies, dcp-build-dataset, dcp-profile over its
measurements, dcp-dry-run; dcp-gpu-check: tests/test_gpu_check.py) draw it."""

from __future__ import annotations

import io
import sys

from megatron_dcp.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_drawn_on_a_terminal_and_silent_in_a_log():
    tty, log = _Terminal(), io.StringIO()
    for stream in (tty, log):
        with Progress("ranks", total=4, stream=stream) as bar:
            for r in range(4):
                bar.update(label=f"rank {r}")
    assert log.getvalue() == ""
    text = tty.getvalue()
    assert "ranks [" + "#" * 30 + "] 4/4" in text and "rank 3" in text and text.endswith("\n")


def test_without_a_total_it_counts():
    tty = _Terminal()
    with Progress("documents", stream=tty) as bar:
        bar.update(5, label="100 tokens")
    assert "documents 5" in tty.getvalue() and "100 tokens" in tty.getvalue()


def _on_a_terminal(monkeypatch) -> _Terminal:
    import sys

    tty = _Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    return tty


def test_simulate_draws_the_policies(monkeypatch, capsys):
    from tools import simulate

    tty = _on_a_terminal(monkeypatch)
    assert simulate.main(["--gpus", "8", "--policy", "dcp,bucket",
                          "--global-batch-tokens", "65536"]) == 0
    assert "planning [" in tty.getvalue() and "2/2" in tty.getvalue()


def test_build_dataset_draws_documents(monkeypatch, tmp_path):
    from tools import build_indexed_dataset

    tty = _on_a_terminal(monkeypatch)
    assert build_indexed_dataset.main(["--embedded", "--output-prefix",
                                       str(tmp_path / "corpus")]) == 0
    assert "documents " in tty.getvalue() and "tokens" in tty.getvalue()


def test_note_prints_above_the_bar_and_alone_in_a_log(capsys):
    tty, log = _Terminal(), io.StringIO()
    for stream in (tty, log):
        with Progress("points", total=2, stream=stream) as bar:
            bar.update(0, label="first")
            bar.note("point 1: 0.5 s")
            bar.update(2)
    assert capsys.readouterr().out == "point 1: 0.5 s\n" * 2
    assert log.getvalue() == ""
    drawn = tty.getvalue().split("\r")  # bar, erased, (the line on stdout), the bar again
    assert drawn[1].startswith("points [") and drawn[2] == " " * 120 and drawn[3] == ""
    assert drawn[4].startswith("points [") and "first" in drawn[4]


def test_profile_draws_the_measurements(monkeypatch, tmp_path, capsys):
    import torch

    from tools import profile_hardware

    tiny = ["--quick", "--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2",
            "--ffn", "64", "--vocab", "64", "--lengths", "32,64", "--pack-sizes", "512",
            "--repeat", "1", "--ranks", "0"]
    threads = torch.get_num_threads()  # the profiler sets its own
    tty = _on_a_terminal(monkeypatch)
    try:
        assert profile_hardware.main([*tiny, "--out", str(tmp_path / "p.json")]) == 0
        monkeypatch.setattr("sys.stderr", io.StringIO())
        assert profile_hardware.main([*tiny, "--out", str(tmp_path / "q.json")]) == 0
        assert sys.stderr.getvalue() == ""  # not a terminal: no bar
    finally:
        torch.set_num_threads(threads)
    text = tty.getvalue()
    assert "profiling [" + "#" * 30 + "] 4/4" in text and "packed tasks" in text
    assert capsys.readouterr().out.count("GEMM: ") == 2


def test_heartbeat_names_the_stage_of_long_work_also_in_a_log():
    """Silent for work shorter than ``after``; past it a line per stage and every ``every``
    seconds within one (a thread: one long call is not silent)."""
    import time

    from megatron_dcp.progress import Heartbeat

    quick = io.StringIO()
    with Heartbeat("dcp-simulate", after=5.0, stream=quick) as beat:
        beat.stage("planning with dcp")
    assert quick.getvalue() == ""
    log = io.StringIO()
    with Heartbeat("dcp-simulate", after=0.0, every=0.5, stream=log) as beat:
        beat.stage("planning with dcp (1 of 2 policies)")
        time.sleep(1.6)  # one long call: the thread speaks
        beat.stage("simulating the dcp plan")
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("[dcp-simulate] 0 s: planning with dcp (1 of 2 policies) ...")
    assert sum("planning with dcp" in line for line in lines) >= 2
    assert lines[-1].endswith("simulating the dcp plan ...")
