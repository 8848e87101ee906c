"""Run a training script as ``__main__`` and, when it exits, print the native threads still in
the process (Linux: ``/proc/self/task/*/comm``) as one line:
``THREADS_AT_EXIT {"rank": R, "threads": [...]}``.

Launch it where the script would be launched: ``deepspeed tests/threads_at_exit.py
examples/pretrain.py ARGS`` or ``torchrun ... tests/threads_at_exit.py SCRIPT ARGS`` (a
``--local_rank`` the launcher puts first is passed on to the script).
"""

from __future__ import annotations

import glob
import json
import os
import runpy
import sys


def native_threads() -> list[str]:
    """The names of this process's threads (empty where /proc is missing)."""
    names = []
    for path in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(path) as handle:
                names.append(handle.read().strip())
        except OSError:  # the thread ended while we looked
            pass
    return sorted(names)


def main() -> None:
    launcher_args = [a for a in sys.argv[1:] if a.startswith("--local_rank")]
    rest = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    script, script_args = rest[0], rest[1:]
    sys.argv = [script, *launcher_args, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        line = json.dumps({"rank": int(os.environ.get("RANK", 0)), "threads": native_threads()})
        sys.stdout.flush()
        # one write of a short line: ranks sharing the launcher's pipe cannot interleave it
        os.write(sys.stdout.fileno(), f"THREADS_AT_EXIT {line}\n".encode())


if __name__ == "__main__":
    main()
