"""What the checkpoint checksums cost: saving a 1 GiB state with and without them.

    OMP_NUM_THREADS=1 python benchmarks/bench_checkpoint_checksum.py
    OMP_NUM_THREADS=1 python benchmarks/bench_checkpoint_checksum.py --gib 1 --repeats 7 --dir D

One process saves the same state (``--gib`` GiB of fp32 tensors of 64 MiB, as a model and its
optimizer states are) to ``--dir`` (default: a temporary directory), each save followed by an
fsync as `save_atomically` does, in these ways, alternating their order every round:

* ``torch.save(path)``: how the files were written before checksums (the Megatron example);
* ``torch.save(file)``: the same through a Python file object, without a checksum;
* ``save_file``: through `ChecksumWriter` (CRC-32 of the bytes as they are written, a large
  write's on a helper thread while the file takes it), and the same with no helper thread;
* ``torch.save(path)`` + ``file_checksum``: checksummed afterwards by reading the file back
  (what rank 0 does for a file written another way).

Also timed alone: the CRC-32 of the state's bytes in memory, and `file_checksum` of the saved
file (what verification reads on ``--load``). Reported: the median of ``--repeats`` rounds (and
the CPU seconds of every thread of the process, which other jobs on the machine disturb less) and
each way's cost over ``torch.save(path)`` and over ``torch.save(file)`` (the same writer without
the checksum), as a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import zlib

import torch

from megatron_dcp.runtime.checkpoint_dir import ChecksumWriter, file_checksum, save_file


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _plain_path(state: dict, path: str) -> None:
    torch.save(state, path)
    _fsync(path)


def _plain_file(state: dict, path: str) -> None:
    with open(path, "wb") as handle:
        torch.save(state, handle)
    _fsync(path)


def _checksummed(state: dict, path: str) -> None:
    save_file(state, path)
    _fsync(path)


def _checksummed_inline(state: dict, path: str) -> None:
    ChecksumWriter.OVERLAP_BYTES, overlap = 1 << 62, ChecksumWriter.OVERLAP_BYTES
    try:
        _checksummed(state, path)
    finally:
        ChecksumWriter.OVERLAP_BYTES = overlap


def _reread(state: dict, path: str) -> None:
    _plain_path(state, path)
    file_checksum(path)


WAYS = {"torch.save(path)": _plain_path, "torch.save(file)": _plain_file,
        "save_file (checksum while writing)": _checksummed,
        "save_file, no helper thread": _checksummed_inline,
        "torch.save(path) + file_checksum (read back)": _reread}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="size of the state")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args()
    count = max(1, round(args.gib * 16))  # tensors of 64 MiB
    state = {f"layer{i}.weight": torch.randn(16 << 20) for i in range(count)}
    size = sum(t.numel() * t.element_size() for t in state.values())
    times: dict[str, list[float]] = {name: [] for name in [*WAYS, "crc32 in memory",
                                                           "file_checksum (verify on load)"]}
    load_before = os.getloadavg()[0]
    cpu: dict[str, list[float]] = {name: [] for name in WAYS}  # CPU seconds, all threads
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        path = os.path.join(work, "rank_0.pt")
        names = list(WAYS)
        for round_ in range(args.repeats):
            for name in names if round_ % 2 == 0 else names[::-1]:
                if os.path.exists(path):
                    os.remove(path)
                t0, c0 = time.perf_counter(), time.process_time()
                WAYS[name](state, path)
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
            t0 = time.perf_counter()
            file_checksum(path)
            times["file_checksum (verify on load)"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            crc = 0
            for tensor in state.values():
                crc = zlib.crc32(tensor.numpy().view("uint8"), crc)
            times["crc32 in memory"].append(time.perf_counter() - t0)
    base = statistics.median(times["torch.save(path)"])
    same = statistics.median(times["torch.save(file)"])
    print(f"{size / 2**30:.2f} GiB in {count} tensors, {args.repeats} rounds; load average "
          f"(1 min) {load_before:.1f} before, {os.getloadavg()[0]:.1f} after\n")
    print("| way | seconds (median) | min | max | vs torch.save(path) | vs torch.save(file) "
          "| CPU seconds (median) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, values in times.items():
        med = statistics.median(values)
        if name in WAYS:
            cost = f"{(med - base) / base:+.1%} | {(med - same) / same:+.1%} | " \
                f"{statistics.median(cpu[name]):.3f}"
        else:
            cost = f"{med / base:.1%} of it | {med / same:.1%} of it | {med:.3f}"
        print(f"| {name} | {med:.3f} | {min(values):.3f} | {max(values):.3f} | {cost} |")

if __name__ == "__main__":
    main()
