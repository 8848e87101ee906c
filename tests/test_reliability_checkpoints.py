"""Checkpoints: atomic saves, verified loads, and resume at another world size (elastic).

* The protocol (`megatron_dcp.runtime.checkpoint_dir`) with real processes: a rank that dies
  while writing its shard leaves ``latest`` on the previous checkpoint, which still loads; a
  checkpoint with a file missing or cut short fails on every rank, naming the file (corrupt
  files of the same size: tests/test_checkpoint_integrity.py).
* DeepSpeed, launched the way users launch: ``examples/pretrain.py`` saves at 2 ranks after 4
  iterations (and after 6); resumed at 1 rank and at 4 ranks for 2 more iterations, the losses
  equal the uninterrupted run's (fp32, relative error <= 1e-5), at ZeRO 1 and ZeRO 3. One launch
  per world size runs this file as the training script (DeepSpeed's start-up is the slow part).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from distributed import DistributedError, launch_deepspeed, run_distributed

ROOT = Path(__file__).resolve().parents[1]
REL_TOL = 1e-5
STAGES = (1, 3)
COMMON = ["--global-batch-tokens", "2048", "--seq-length", "512", "--num-layers", "2",
          "--hidden-size", "32", "--num-heads", "4", "--seed", "7", "--quiet", "--dcp"]


# ---------------------------------------------------------------------- the protocol
def _write_shard(staging_dir: str, rank: int, payload: bytes, crash: bool) -> None:
    os.makedirs(staging_dir, exist_ok=True)
    with open(os.path.join(staging_dir, f"shard_{rank}.bin"), "wb") as handle:
        if crash:  # half a shard on disk, then the process dies (as the killed rank)
            handle.write(payload[: len(payload) // 2])
            handle.flush()
            os._exit(17)
        handle.write(payload)


def _saves(rank: int, world_size: int, root: str) -> str:
    from megatron_dcp.runtime.checkpoint_dir import save_atomically

    for step in (1, 2):
        crash = step == 2 and rank == 1

        def write(staging: str) -> None:
            _write_shard(os.path.join(root, staging), rank, bytes([step]) * 4096, crash)

        save_atomically(root, f"iter_{step}", write, meta={"iteration": step})
    return "saved"


@pytest.mark.slow
def test_rank_dying_mid_save_leaves_the_previous_checkpoint(tmp_path):
    from megatron_dcp.runtime.checkpoint_dir import read_latest
    from megatron_dcp.runtime.checkpoint_verify import verify_checkpoint

    root = str(tmp_path / "ckpt")
    with pytest.raises(DistributedError) as failure:
        run_distributed(_saves, world_size=2, args=(root,), grace_s=5.0, group_timeout_s=20)
    assert 1 in failure.value.failures
    assert read_latest(root) == "iter_1"
    assert not os.path.exists(os.path.join(root, "iter_2"))
    tag, manifest = verify_checkpoint(root)  # the previous checkpoint still loads
    assert tag == "iter_1" and manifest["iteration"] == 1
    assert sorted(manifest["files"]) == ["shard_0.bin", "shard_1.bin"]
    for name in manifest["files"]:
        assert Path(root, "iter_1", name).read_bytes() == bytes([1]) * 4096


def _failing_write(rank: int, world_size: int, root: str) -> str:
    from megatron_dcp.runtime.checkpoint_dir import CheckpointError, save_atomically

    save_atomically(root, "iter_1", lambda staging: _write_shard(
        os.path.join(root, staging), rank, b"x" * 64, False))

    def write(staging: str) -> None:
        if rank == 1:
            raise OSError(28, "No space left on device")
        _write_shard(os.path.join(root, staging), rank, b"y" * 64, False)

    try:
        save_atomically(root, "iter_2", write)
    except CheckpointError as err:
        return str(err)
    return "saved"


@pytest.mark.slow
def test_failed_write_is_an_error_on_every_rank(tmp_path):
    root = str(tmp_path / "ckpt")
    for message in run_distributed(_failing_write, world_size=2, args=(root,)):
        assert "checkpoint 'iter_2'" in message and "latest still names 'iter_1'" in message
        assert "rank 1: the disk is full" in message
        assert "OSError: [Errno 28] No space left on device" in message
    assert Path(root, "latest").read_text().strip() == "iter_1"
    assert not Path(root, "iter_2.partial").exists()  # its space given back


def test_incomplete_checkpoints_name_what_is_missing(tmp_path):
    from megatron_dcp.runtime.checkpoint_dir import CheckpointError, prune, save_atomically
    from megatron_dcp.runtime.checkpoint_verify import split_load_path, verify_checkpoint

    root = tmp_path / "ckpt"
    with pytest.raises(CheckpointError, match="does not exist"):
        verify_checkpoint(str(root))
    for step in (1, 2, 3):
        save_atomically(str(root), f"iter_{step}", lambda staging: _write_shard(
            str(root / staging), 0, b"z" * 100, False))
    assert split_load_path(str(root / "iter_2")) == (str(root), "iter_2")
    assert split_load_path(str(root)) == (str(root), None)
    (root / "iter_3" / "shard_0.bin").unlink()
    with pytest.raises(CheckpointError, match=r"iter_3 is incomplete: missing shard_0.bin"):
        verify_checkpoint(str(root), "iter_3")
    (root / "iter_2" / "shard_0.bin").write_bytes(b"z" * 10)
    with pytest.raises(CheckpointError, match=r"wrong size shard_0.bin \(10 of 100 bytes\)"):
        verify_checkpoint(str(root), "iter_2")
    (root / "iter_1" / "dcp_manifest.json").unlink()
    with pytest.raises(CheckpointError, match="iter_1 is incomplete: it has no dcp_manifest"):
        verify_checkpoint(str(root), "iter_1")
    # --keep-last: the oldest complete ones go, never the one latest names
    for step in (4, 5):
        save_atomically(str(root), f"iter_{step}", lambda staging: _write_shard(
            str(root / staging), 0, b"z" * 100, False), keep_last=2)
    (root / "iter_9.partial").mkdir()
    assert prune(str(root), 2) == []
    assert sorted(p.name for p in root.iterdir()) == ["iter_1", "iter_4", "iter_5", "latest"]


# ---------------------------------------------------------------------- DeepSpeed, elastic
def _losses(path: str) -> dict[int, float]:
    with open(path) as f:
        return {r["iteration"]: r["loss"] for r in map(json.loads, f) if r}


def _job(work: str, phase: str) -> None:
    """Runs inside a launched job: ``save`` (6 iterations, checkpoints every 2, keep 2) or
    ``resume`` (from iteration 4's checkpoint, at this job's world size)."""
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "examples"))
    import pretrain

    from megatron_dcp.runtime.checkpoint_dir import CheckpointError

    from megatron_dcp.runtime import checkpoint_dir

    world = int(os.environ["WORLD_SIZE"])
    reread, checksum = [], checkpoint_dir.file_checksum  # files checksummed by reading them back
    checkpoint_dir.file_checksum = lambda path: reread.append(os.path.basename(path)) or \
        checksum(path)
    for stage in STAGES:
        ckpt = os.path.join(work, f"ckpt_zero{stage}")
        flags = COMMON + ["--zero-stage", str(stage), "--train-iters", "6"]
        if phase == "save":
            pretrain.main(flags + ["--save", ckpt, "--save-interval", "2", "--keep-last", "2",
                                   "--log-json", os.path.join(work, f"straight{stage}.jsonl")])
            if dist.get_rank() == 0:
                with open(os.path.join(work, f"reread{stage}.txt"), "w") as f:
                    f.write(" ".join(sorted(set(reread))))
            continue
        pretrain.main(flags + ["--load", os.path.join(ckpt, "iter_4"), "--log-json",
                               os.path.join(work, f"resumed{stage}_w{world}.jsonl")])
    if phase == "resume" and world == 1:  # a shard lost: the error names it, nothing is loaded
        broken = os.path.join(work, "broken")
        shutil.copytree(os.path.join(work, "ckpt_zero1"), broken)
        os.remove(os.path.join(broken, "iter_6", "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
        try:  # this checkpoint, by name (loading latest would fall back to iter_4)
            pretrain.main(COMMON + ["--zero-stage", "1", "--load", os.path.join(broken, "iter_6")])
            message = "loaded"
        except CheckpointError as err:
            message = str(err)
        with open(os.path.join(work, "broken.txt"), "w") as f:
            f.write(message)
        # 64 bytes flipped in an optimizer shard of latest (same size): iter_4 is loaded instead
        corrupt = os.path.join(work, "corrupt")
        shutil.copytree(os.path.join(work, "ckpt_zero1"), corrupt)
        with open(os.path.join(corrupt, "iter_6", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                  "r+b") as f:
            f.seek(os.fstat(f.fileno()).st_size // 2)
            data = f.read(64)
            f.seek(-len(data), os.SEEK_CUR)
            f.write(bytes(b ^ 0xFF for b in data))
        pretrain.main(COMMON + ["--zero-stage", "1", "--train-iters", "6", "--load", corrupt,
                                "--log-json", os.path.join(work, "corrupt.jsonl")])
    dist.barrier()


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_resume_at_another_world_size_continues_the_trajectory(tmp_path):
    work = str(tmp_path)
    said = {}
    for world, phase, timeout in ((2, "save", 150), (1, "resume", 130), (4, "resume", 160)):
        proc = launch_deepspeed(world, [__file__, "--work", work, "--phase", phase], timeout)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        said[world] = proc.stdout + proc.stderr
    for stage in STAGES:
        ckpt = tmp_path / f"ckpt_zero{stage}"
        # --keep-last 2 removed iter_2; iter_4 has its universal conversion beside it
        assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == [
            "iter_4", "iter_4.universal", "iter_6"]
        assert (ckpt / "latest").read_text().strip() == "iter_6"
        straight = _losses(str(tmp_path / f"straight{stage}.jsonl"))
        assert sorted(straight) == [1, 2, 3, 4, 5, 6]
        for world in (1, 4):
            resumed = _losses(str(tmp_path / f"resumed{stage}_w{world}.jsonl"))
            assert sorted(resumed) == [5, 6], resumed
            for it, loss in resumed.items():
                assert abs(loss - straight[it]) <= REL_TOL * straight[it], (stage, world, it)
    broken = (tmp_path / "broken.txt").read_text()
    assert "iter_6 is incomplete: missing zero_pp_rank_1_mp_rank_00_optim_states.pt" in broken
    said = said[1]  # the world-1 resume: the corrupt shard is named, iter_4 loaded instead
    assert "iter_6 is corrupt: the checksum of zero_pp_rank_1_mp_rank_00_optim_states.pt" in said
    assert f"loading {tmp_path / 'corrupt' / 'iter_4'} instead" in said
    straight = _losses(str(tmp_path / "straight1.jsonl"))
    corrupt = _losses(str(tmp_path / "corrupt.jsonl"))
    assert sorted(corrupt) == [5, 6]
    for it, loss in corrupt.items():
        assert abs(loss - straight[it]) <= REL_TOL * straight[it], it
    for stage in STAGES:  # DeepSpeed's files were checksummed while written, none read back
        assert (tmp_path / f"reread{stage}.txt").read_text() == ""


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--work", required=True)
    p.add_argument("--phase", choices=("save", "resume"), required=True)
    a = p.parse_args()
    try:
        _job(a.work, a.phase)
    finally:
        from megatron_dcp.runtime.groups import destroy_process_groups

        destroy_process_groups()
