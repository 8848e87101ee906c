"""The logs ``dcp-report`` reads: a DCP JSON log (checked row by row) and, for ``--baseline``,
also a plain run's: an examples' ``--log-json`` without ``--dcp`` or Megatron-LM's own console
log (its ``iteration N/M | ... | lm loss: ...`` lines), whose tokens are Megatron-LM's own
count (global batch size x ``--seq-length``, the ``seq_length`` its argument dump prints).

A Megatron-LM console log given as the DCP log is named as one: the report needs the JSON rows
the launcher writes with ``--dcp-log-json PATH``.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from megatron_dcp.runtime.report import log_rows, timeline_bars

TEXT_LOG_HINT = ("it looks like Megatron-LM's console log; dcp-report reads the JSON rows the "
                 "launcher writes with --dcp-log-json PATH (add it to the pretrain_gpt.py "
                 "command line beside --dcp, then: dcp-report PATH); a plain Megatron-LM log "
                 "can be the --baseline of such a report")

_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|")
_SEQ_LENGTH = re.compile(r"^\s*seq_length\s+\.+\s+(\d+)\s*$")
_NUMBER = (int, float)


class LogError(ValueError):
    """A file that is not a DCP JSON log: the message names the file and line."""


def megatron_text_line(line: str) -> bool:
    """Whether ``line`` is one of Megatron-LM's iteration lines (``iteration 3/ 10 | ...``) or
    a line of its argument dump / start-up (``seq_length ..... 1024``, ``using world size``)."""
    return bool(_ITERATION.search(line) and "|" in line) or bool(_SEQ_LENGTH.match(line)) \
        or line.startswith(("using world size:", "------------------------ arguments"))


def _looks_like_text_log(path: str) -> bool:
    """Whether one of the first 2,000 lines of ``path`` is Megatron-LM's (`megatron_text_line`)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for k, line in enumerate(f):
                if k >= 2000:
                    break
                if megatron_text_line(line):
                    return True
    except OSError:
        return False
    return False


def read_log(path: str) -> list[dict[str, Any]]:
    """The rows of a DCP JSON log, each checked: a JSON object with an ``iteration`` and the
    ``plan`` summary every DCP row carries (``{"mode": ...}``), the figures the report reads of
    the right types, and a ``timeline`` whose tasks lie inside its world (`timeline_bars`);
    otherwise `LogError` naming the file and line, before anything is drawn. A Megatron-LM
    console log is named as one (`TEXT_LOG_HINT`)."""
    rows = []
    try:
        for number, row in log_rows(path):
            plan = row.get("plan") if isinstance(row, dict) else None
            if not (isinstance(row, dict) and isinstance(row.get("iteration"), int)
                    and isinstance(plan, dict) and "mode" in plan):
                raise LogError(f"{path}:{number}: not a DCP JSON log row (one written by "
                               "--log-json or --dcp-log-json has 'iteration' and 'plan')")
            check_row(row, f"{path}:{number}")
            rows.append(row)
    except LogError:
        raise
    except ValueError as err:  # log_rows: the line is named
        if "not JSON" in str(err) and _looks_like_text_log(path):
            raise LogError(f"{str(err).split(': not JSON')[0]}: not JSON: {TEXT_LOG_HINT}") \
                from None
        raise LogError(str(err)) from None
    if not rows:
        raise LogError(f"{path}: no rows")
    return rows


def _number(value: Any) -> bool:
    return isinstance(value, _NUMBER) and not isinstance(value, bool)


def check_row(row: dict[str, Any], where: str) -> None:
    """`LogError` at ``where`` (``file:line``) for a row whose figures are of the wrong type (a
    step time ``"fast"``, degrees that are not counts), whose ``run`` is not an object, or whose
    timeline is malformed (its tasks, its ``measured_s`` and per-rank ``ranks`` lists)."""
    for key in ("step_s", "predicted_s", "loss", "tokens", "tokens_per_s", "tokens_run",
                "tokens_run_per_s", "lr", "peak_mem_mb", "grad_norm"):
        value = row.get(key)
        if value is not None and not _number(value):
            raise LogError(f"{where}: {key} {json.dumps(value)[:40]} is not a number")
    if row.get("run") is not None and not isinstance(row["run"], dict):
        raise LogError(f"{where}: run is a {type(row['run']).__name__}, not an object")
    plan = row["plan"]
    for key, kind in (("degrees", dict), ("micro_steps_per_rank", list),
                      ("recompute_layers", list)):
        if plan.get(key) is not None and not isinstance(plan[key], kind):
            raise LogError(f"{where}: plan {key} is a {type(plan[key]).__name__}, not a "
                           f"{kind.__name__}")
    for degree, count in (plan.get("degrees") or {}).items():
        if not _number(count):
            raise LogError(f"{where}: plan degrees {degree}: {json.dumps(count)[:40]} is not a "
                           "count")
    if row.get("timeline") is not None:
        try:
            timeline_bars(row["timeline"])
        except ValueError as err:
            raise LogError(f"{where}: {err}") from None
        _check_timeline_extras(row["timeline"], where)


def _check_timeline_extras(timeline: dict[str, Any], where: str) -> None:
    """``measured_s`` (a number or null per task) and ``ranks`` (lists of numbers, one per
    rank of the world) of a timeline, where present."""
    measured = timeline.get("measured_s")
    if measured is not None and not (isinstance(measured, list)
                                     and len(measured) == len(timeline["tasks"])
                                     and all(v is None or _number(v) for v in measured)):
        raise LogError(f"{where}: timeline measured_s is not a number (or null) per task")
    ranks = timeline.get("ranks")
    if ranks is None:
        return
    if not isinstance(ranks, dict):
        raise LogError(f"{where}: timeline ranks is not an object of per-rank lists")
    for key, values in ranks.items():
        if not (isinstance(values, list) and len(values) <= timeline["world_size"]
                and all(v is None or _number(v) for v in values)):
            raise LogError(f"{where}: timeline ranks {key} is not a number per rank")


def read_baseline(path: str) -> list[dict[str, Any]]:
    """``--baseline``: the rows of a plain run's log, a DCP JSON log (`read_log`, any mode) or
    a Megatron-LM console log (`megatron_text_rows`); `LogError` naming the file otherwise."""
    try:
        return read_log(path)
    except LogError as err:
        if TEXT_LOG_HINT not in str(err):
            raise
    rows = megatron_text_rows(path)
    if not rows:
        raise LogError(f"{path}: no Megatron-LM iteration line (' iteration N/M | ... | lm "
                       "loss: ...') in this console log")
    return rows


def _fields(line: str) -> dict[str, str]:
    """``key: value`` pairs of one Megatron-LM iteration line."""
    out = {}
    for part in line.split("|"):
        key, sep, value = part.rpartition(":")
        if sep:
            out[key.strip().split("]")[-1].strip()] = value.strip()
    return out


def megatron_text_rows(path: str) -> list[dict[str, Any]]:
    """Rows of a Megatron-LM console log, in the report's row format: ``loss`` (``lm loss``),
    ``step_s`` (elapsed time per iteration), ``tokens`` (global batch size x ``seq_length``,
    where the argument dump gives it) and ``tokens_per_s``, ``grad_norm``, ``lr``,
    ``tflops_per_gpu``; ``plan`` ``{"mode": "megatron-lm"}``."""
    rows: list[dict[str, Any]] = []
    seq_length: Optional[int] = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            size = _SEQ_LENGTH.match(line)
            if size:
                seq_length = int(size.group(1))
            found = _ITERATION.search(line)
            if not found:
                continue
            fields = _fields(line[found.end():])
            row: dict[str, Any] = {"iteration": int(found.group(1)),
                                   "plan": {"mode": "megatron-lm"}}
            for key, name in (("lm loss", "loss"), ("grad norm", "grad_norm"),
                              ("learning rate", "lr"),
                              ("throughput per GPU (TFLOP/s/GPU)", "tflops_per_gpu")):
                try:
                    row[name] = float(fields[key])
                except (KeyError, ValueError):
                    pass
            try:
                row["step_s"] = float(fields["elapsed time per iteration (ms)"]) / 1e3
                batch = int(fields["global batch size"])
            except (KeyError, ValueError):
                rows.append(row)
                continue
            if seq_length:
                row["tokens"] = batch * seq_length
                row["tokens_per_s"] = row["tokens"] / row["step_s"] if row["step_s"] else 0.0
            rows.append(row)
    return rows
