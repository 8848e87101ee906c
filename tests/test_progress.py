"""The tools' progress bar: drawn on a terminal, silent in a log; the tools that do long work
(dcp-simulate over policies, dcp-build-dataset, dcp-dry-run) draw it."""

from __future__ import annotations

import io

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
