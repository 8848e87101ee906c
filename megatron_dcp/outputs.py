"""The files the tools write (``dcp-report``'s picture and page, ``dcp-simulate --plot`` and
``--save-plan``, ``dcp-dry-run --json``), checked while the arguments are parsed, before any
work: a path that is one of the run's inputs is refused (the output would replace what it was
made from), and an existing file is replaced only when the same tool wrote it (each output
carries its tool's mark: `mark`) or the user says ``--overwrite``. Nothing a user had is lost
to a typo, and a path that cannot be written fails at once, not after the run.

Pure Python, no torch: the plan layer's simulator and the report tool use it on a laptop.
"""

from __future__ import annotations

import os
from typing import Iterable, Optional

OVERWRITE_HELP = ("replace an existing output file that this tool did not write (by default "
                  "such a file is refused, and one this tool wrote is replaced)")
"""The ``--overwrite`` help text, the same for every tool."""

_PEEK = 1 << 16
"""Bytes read from each end of an existing file to find its mark: a PNG's text chunk is near
its start, an HTML page's ``<meta>`` in its head, a JSON key first or last."""


def mark(tool: str) -> str:
    """What an output of ``tool`` carries (a PNG's ``Software`` text, the page's ``generator``
    meta, a JSON report's ``written_by``): how a later run knows it may replace that file."""
    return f"{tool} (megatron-dcp)"


def written_by(path: str, tool: str) -> bool:
    """Whether the file at ``path`` carries ``tool``'s `mark` in its first or last 64 KiB."""
    needle = mark(tool).encode()
    try:
        with open(path, "rb") as f:
            head = f.read(_PEEK)
            size = f.seek(0, os.SEEK_END)
            f.seek(max(len(head), size - _PEEK))
            tail = f.read(_PEEK)
    except OSError:
        return False
    return needle in head or needle in tail


def same_file(a: str, b: str) -> bool:
    """Whether two paths name one file (also through links, or before it exists)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def output_problem(path: str, *, flag: str, tool: str,
                   inputs: Iterable[tuple[str, Optional[str]]] = (),
                   overwrite: bool = False, make_folder: bool = False) -> Optional[str]:
    """Why ``path`` (given as ``flag``) may not be written, in one line, or ``None``.

    ``inputs``: (flag, path) of every file the run reads (``None``: not given); ``overwrite``:
    an existing file that ``tool`` did not write may be replaced; ``make_folder``: the tool
    creates a missing folder, so the nearest existing one must be writable."""
    if not path or path.endswith(os.sep) or os.path.isdir(path):
        return (f"{flag} {path!r} is a folder or empty: give a file path"
                + (" (a stem such as DIR/run)" if make_folder else ""))
    for name, given in inputs:
        if given and os.path.exists(given) and same_file(path, given):
            return (f"{flag} {path} is the input {name} {given}: writing it would destroy "
                    f"that input; give {flag} another path")
    folder = os.path.dirname(os.path.abspath(path))
    if make_folder:
        while not os.path.exists(folder) and os.path.dirname(folder) != folder:
            folder = os.path.dirname(folder)
        if not os.path.isdir(folder):
            return f"{flag} {path}: {folder} is a file, not a folder"
    elif not os.path.isdir(folder):
        return f"{flag} {path}: the folder {folder} does not exist (create it first)"
    if os.path.lexists(path):
        if not os.path.isfile(path):
            return f"{flag} {path} exists and is not a regular file: give another path"
        if not overwrite and not written_by(path, tool):
            return (f"{flag} {path} already exists and was not written by {tool}: add "
                    "--overwrite to replace it, or give another path")
        try:  # opens for appending without changing a byte: the run's write will succeed
            with open(path, "ab"):
                pass
        except OSError as err:
            return f"{flag} {path}: cannot be written ({err.strerror or err})"
    elif not os.access(folder, os.W_OK | os.X_OK):
        return f"{flag} {path}: the folder {folder} is not writable"
    return None
