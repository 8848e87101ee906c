"""Whose file a training log is: ``--log-json`` (examples) and ``--dcp-log-json`` (the launcher)
write a file only when it is new (absent or empty), when the user asked to replace it
(``--overwrite-log``; the launcher: ``--dcp-overwrite-log``), or when it is this run's own: a
resume (``--load``) of the run that wrote it. A resumed log keeps its rows up to the loaded
iteration and continues after it, so its iterations never go back in time (`open_log`).

How a log is recognised as this run's own: every row carries ``checkpoint_dir``
(`CHECKPOINT_DIR_KEY`), the real path of the directory the run's checkpoints go to (``--save``,
else the ``--load`` directory: `checkpoint_dir`). A run resuming from ``--load DIR`` owns the
log whose last row names DIR: it is the run that saved the checkpoint being loaded, since no two
runs share a ``--save`` directory (`checkpoint_verify.takeover_problem` refuses that). This needs
nothing stored in the checkpoints, and is decided while parsing the flags, before any checkpoint
is read. A log whose rows name another directory or none, or a file that is not a log, is
refused (`log_problem`), naming the flag and the one that replaces it.

Pure Python: every front end (DeepSpeed examples, Megatron example, launcher) uses it.
"""

from __future__ import annotations

import json
import os
import sys
from typing import IO, Iterator, Optional

CHECKPOINT_DIR_KEY = "checkpoint_dir"
"""The log row's field naming the run's checkpoint directory (see the module docstring)."""


def checkpoint_dir(save: Optional[str], load_dir: Optional[str]) -> Optional[str]:
    """The checkpoint directory a run's rows belong to: the real path of ``save``, else of
    ``load_dir`` (a run that only loads continues that directory's run), else None."""
    where = save or load_dir
    return os.path.realpath(where) if where else None


def _rows(path: str) -> Iterator[tuple[int, str, Optional[dict]]]:
    """(line number, line, row) of the log at ``path``; row is None for a line that is no JSON
    object with an integer ``iteration``. A last line without its newline that does not parse is
    left out (a write cut short by a crash)."""
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                if not line.endswith("\n"):
                    return
                row = None
            ok = isinstance(row, dict) and isinstance(row.get("iteration"), int) \
                and not isinstance(row.get("iteration"), bool)
            yield number, line if line.endswith("\n") else line + "\n", row if ok else None


def _has_content(path: str) -> bool:
    try:
        return os.path.isfile(path) and os.path.getsize(path) > 0
    except OSError:
        return False


def log_problem(path: Optional[str], *, flag: str, overwrite_flag: str,
                load_dir: Optional[str]) -> str:
    """Why this run may not write its log at ``path`` (``""`` when it may: no log asked for, a
    new or empty file, or this run's own log). ``load_dir``: the directory of ``--load`` when
    the run resumes (None otherwise: then an existing log is always another run's). ``flag``
    and ``overwrite_flag`` are the front end's names, for the message."""
    if not path or not _has_content(path):
        return ""
    choices = f"give {flag} another file, or add {overwrite_flag} to replace it"
    first = last = None
    count = 0
    try:
        for number, _, row in _rows(path):
            if row is None:
                return (f"{flag} {path} exists and is not a training log (line {number} is "
                        f"not a JSON row with an integer iteration): this run would replace it; "
                        f"{choices}")
            count += 1
            first = row if first is None else first
            last = row
    except (OSError, UnicodeDecodeError) as err:
        return (f"{flag} {path} exists and is not a readable training log "
                f"({type(err).__name__}: {err}): this run would replace it; {choices}")
    if last is None:  # only blank lines or a cut first line: nothing to lose
        return ""
    held = (f"{count} row{'s' if count != 1 else ''}, iterations {first['iteration']}.."
            f"{last['iteration']}")
    if load_dir is None:
        return (f"{flag} {path} already holds a training log ({held}): this run (no --load) "
                f"would replace it; resume the run that wrote it with --load (its log then "
                f"continues), {choices}")
    theirs, ours = last.get(CHECKPOINT_DIR_KEY), os.path.realpath(load_dir)
    if theirs == ours:
        return ""
    whose = (f"its rows belong to the checkpoints in {theirs}" if theirs else
             "its rows name no checkpoint directory (written without --save, or by an older "
             "megatron-dcp)")
    return (f"{flag} {path} is another run's training log ({held}): {whose}, while this run "
            f"resumes from {ours}; {choices}")


def open_log(path: str, resume_at: Optional[int], *, flag: str = "--log-json") -> IO[str]:
    """``path`` opened for this run's rows: replaced (``resume_at`` None: a new run, or one that
    asked to overwrite), or, resuming at iteration ``resume_at``, kept up to that iteration's row
    and appended to. Rows of later iterations (the run went on past its checkpoint) are dropped,
    as are rows a resume before this fix appended after later ones (a row going back in time
    replaces the rows from its iteration on); what was dropped is said on stderr. The file is
    rewritten through a temporary file renamed over it: a crash leaves the old or the new log."""
    if resume_at is None:
        return open(path, "w", encoding="utf-8")
    if not _has_content(path):
        return open(path, "a", encoding="utf-8")
    kept: list[tuple[int, str]] = []
    total = 0
    for _, line, row in _rows(path):
        if row is None:  # log_problem refused such a file, unless it changed since
            continue
        total += 1
        while kept and kept[-1][0] >= row["iteration"]:
            kept.pop()
        kept.append((row["iteration"], line))
    kept = [(it, line) for it, line in kept if it <= resume_at]
    dropped = total - len(kept)
    with open(path, "rb") as handle:  # a cut last line is dropped too
        intact = handle.read().endswith(b"\n")
    if dropped or not intact:
        target = os.path.realpath(path)
        tmp = f"{target}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.writelines(line for _, line in kept)
        os.replace(tmp, target)
    last = kept[-1][0] if kept else None
    print(f"[dcp] {flag} {path}: resuming at iteration {resume_at}: kept {len(kept)} rows"
          f"{f' (up to iteration {last})' if kept else ''}, dropped {dropped} "
          f"{'row' if dropped == 1 else 'rows'} of later iterations; the log continues at "
          f"iteration {resume_at + 1}", file=sys.stderr, flush=True)
    return open(path, "a", encoding="utf-8")
