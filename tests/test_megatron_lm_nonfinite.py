"""Non-finite steps through the launcher (issue 48, item 10): with ``--fp16`` Megatron's loss
scaler skips an overflow step and backs its scale off, as in plain Megatron-LM (DCP's check
stopped the run at iteration 1 before); a step DCP skips (``--dcp-skip-nonfinite``) never reaches
Megatron-LM's optimizer step, which would apply the non-finite gradients."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("megatron.training", reason="Megatron-LM's training package (megatron-core "
                    "0.19, Python 3.12: the .venv312 leg of make test)")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_megatron_launcher import PLAIN, _launch, _lm_losses  # noqa: E402

SCALE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?loss scale: ([0-9.]+) \| number of skipped "
                   r"iterations:\s+(\d+)")


class _Optimizer:
    """Megatron's optimizer as ``train_step`` sees it: ``step()`` returns (applied, norm,
    zeros); the calls are counted."""

    def __init__(self) -> None:
        self.calls = 0

    def step(self):
        self.calls += 1
        return True, 1.0, 0


def test_a_skipped_dcp_step_is_a_skipped_megatron_lm_step(monkeypatch):
    """`_train_step`: while the launcher's last step was skipped, Megatron-LM's ``train_step``
    gets (False, None, None) from ``optimizer.step()`` (its own skipped iteration) and the
    optimizer never runs; otherwise the optimizer's own step; the optimizer is left as it
    was."""
    import megatron.training

    from megatron_dcp.megatron.lm import _train_step
    from megatron_dcp.megatron.lm_checkpoint import PlannerCheckpoint

    monkeypatch.setattr(megatron.training, "get_args", lambda: argparse.Namespace(dcp=True))
    saved = PlannerCheckpoint()
    saved.step = SimpleNamespace(skip_update=True)
    wrapped = _train_step(lambda f, it, model, optimizer, *rest: optimizer.step(), saved)
    optimizer = _Optimizer()
    assert wrapped(None, None, None, optimizer) == (False, None, None)
    assert optimizer.calls == 0
    saved.step.skip_update = False
    assert wrapped(None, None, None, optimizer) == (True, 1.0, 0)
    assert optimizer.calls == 1 and "step" not in vars(optimizer)
    # without --dcp: Megatron-LM's own step, untouched
    monkeypatch.setattr(megatron.training, "get_args", lambda: argparse.Namespace(dcp=False))
    saved.step.skip_update = True
    assert wrapped(None, None, None, optimizer) == (True, 1.0, 0)


def _scales(done) -> dict[int, tuple[float, int]]:
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return {int(i): (float(s), int(n)) for i, s, n in SCALE.findall(done.stdout + done.stderr)}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fp16_overflow_steps_are_the_loss_scalers_and_fp16_losses_equal_plain(tmp_path):
    """``--fp16`` at Megatron-LM's default initial scale (2^32): every early step overflows;
    under ``--dcp`` the run goes on as plain Megatron-LM's does (the scale halves each step,
    each iteration is counted skipped by Megatron-LM and by DCP's rows). At a static scale the
    fp16 losses equal plain Megatron-LM's while the plans split documents."""
    log = tmp_path / "dcp.jsonl"
    dynamic = _scales(_launch(["--dcp", "--fp16", "--dcp-max-tokens-per-rank", "200",
                               "--train-iters", "3", "--dcp-log-json", str(log)]))
    assert sorted(dynamic) == [1, 2, 3], dynamic
    assert [dynamic[i][0] for i in (1, 2, 3)] == [2.0 ** 32, 2.0 ** 31, 2.0 ** 30], dynamic
    assert all(skipped >= 1 for _, skipped in dynamic.values()), dynamic
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["skipped"] for r in rows] == [True, True, True], rows
    static = ["--fp16", "--loss-scale", "128"]
    log = tmp_path / "static.jsonl"  # a second run: its own log (the first's is refused)
    dcp = _lm_losses(_launch(["--dcp", "--dcp-max-tokens-per-rank", "200", "--dcp-log-json",
                              str(log), *static]))
    plain = _lm_losses(_launch(PLAIN + static))
    assert sorted(dcp) == sorted(plain) == [1, 2, 3, 4, 5]
    for it in plain:
        assert dcp[it] == pytest.approx(plain[it], rel=1e-5), (it, dcp, plain)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert not any(r["skipped"] for r in rows)
    assert any(int(d) > 1 for r in rows for d in r["plan"]["degrees"]), rows


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("oversize", ["truncate", "skip"])
def test_oversize_truncate_trains_and_an_all_skipped_run_says_so(tmp_path, oversize):
    """Issue 59 through the launcher, ``--dcp-max-tokens-per-rank`` below the documents at
    degree 1: ``truncate`` trains the kept prefixes (it stopped at the first step with a
    ``BatchError``: the plan truncated, the batch did not), its rows count the cut tokens;
    ``skip`` with a cap below every document skips every step before the optimizer and the run
    ends with status 1 saying so (it trained nothing with status 0 and ``loss NaN``)."""
    log = tmp_path / "dcp.jsonl"
    cap = "100" if oversize == "truncate" else "1"
    done = _launch(["--dcp", "--dcp-log-json", str(log), "--dcp-max-degree", "1",
                    "--dcp-max-tokens-per-rank", cap, "--dcp-oversize", oversize,
                    "--train-iters", "2"])
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    text = done.stdout + done.stderr
    if oversize == "truncate":
        losses = _lm_losses(done)
        assert sorted(losses) == [1, 2] and all(v == v for v in losses.values())
        assert any(r["truncated_tokens"] > 0 for r in rows), rows
        assert all(not r["skipped"] and r["tokens"] > 0 for r in rows), rows
    else:
        assert done.returncode != 0, text[-3000:]
        assert "no step trained a token: every sequence was skipped by --dcp-oversize skip" \
            in text, text[-3000:]
        # no traceback of the ranks (torchrun's own agent prints one for any failed child)
        assert "megatron_dcp/" not in text.split("torch/distributed/elastic")[0], text[-3000:]
        assert [(r["skipped"], r["tokens"]) for r in rows] == [(True, 0), (True, 0)], rows
