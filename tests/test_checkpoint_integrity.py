"""Checkpoints that cannot lose work silently (issue 22): per-file checksums written with the
file and verified before anything loads (a corrupt ``latest`` falls back to the newest
checkpoint that verifies, saying so), ``--keep-last`` keeps the newest verified checkpoint,
``latest`` stays inside its directory, ``--save`` is checked at start, a full disk is called
one, and the Megatron example loads its files with ``weights_only=True``."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]
MEGATRON = ROOT / "examples" / "pretrain_megatron.py"


def _save(root: Path, step: int, *, rank: int = 0, group=None, **kwargs) -> None:
    """Checkpoint ``iter_STEP``: one torch file per rank, checksummed while written."""
    from megatron_dcp.runtime.checkpoint_dir import save_atomically, save_file

    def write(staging: str) -> dict:
        os.makedirs(root / staging, exist_ok=True)
        path = str(root / staging / f"rank_{rank}.pt")
        return {path: save_file({"w": torch.full((4096,), float(step)), "step": step}, path)}

    save_atomically(str(root), f"iter_{step}", write, group=group, **kwargs)


def _flip(path: Path, offset: int, count: int = 64) -> None:
    """Invert ``count`` bytes at ``offset`` (the file keeps its size)."""
    data = bytearray(path.read_bytes())
    data[offset:offset + count] = bytes(b ^ 0xFF for b in data[offset:offset + count])
    path.write_bytes(bytes(data))


def test_same_size_corruption_is_named_and_latest_falls_back(tmp_path, capsys):
    from megatron_dcp.runtime.checkpoint_dir import CheckpointError
    from megatron_dcp.runtime.checkpoint_verify import verify_checkpoint

    root = tmp_path / "ckpt"
    for step in (1, 2, 3):
        _save(root, step)
    shard = root / "iter_3" / "rank_0.pt"
    _flip(shard, shard.stat().st_size // 2)
    tag, manifest = verify_checkpoint(str(root))
    assert (tag, manifest["tag"]) == ("iter_2", "iter_2")
    said = capsys.readouterr().err
    assert "iter_3 is corrupt: the checksum of rank_0.pt (crc32:" in said
    assert f"loading {root / 'iter_2'} instead: the newest checkpoint that verifies" in said
    with pytest.raises(CheckpointError, match=r"iter_3 is corrupt: the checksum of rank_0.pt"):
        verify_checkpoint(str(root), "iter_3")  # asked for by name: no fallback
    for step in (1, 2):
        _flip(root / f"iter_{step}" / "rank_0.pt", 100)
    with pytest.raises(CheckpointError, match="no other checkpoint in .* verifies either"):
        verify_checkpoint(str(root))


def test_first_bytes_flipped_names_the_file(tmp_path):
    """Without the checksum, torch.load fails with an UnpicklingError that names no file."""
    from megatron_dcp.runtime.checkpoint_dir import CheckpointError
    from megatron_dcp.runtime.checkpoint_verify import verify_checkpoint

    root = tmp_path / "ckpt"
    _save(root, 1)
    _flip(root / "iter_1" / "rank_0.pt", 0, 8)
    with pytest.raises(CheckpointError, match=r"iter_1 is corrupt: the checksum of rank_0.pt"):
        verify_checkpoint(str(root), "iter_1")


def test_a_file_written_another_way_is_checksummed_by_reading_it(tmp_path):
    from megatron_dcp.runtime.checkpoint_dir import (CheckpointError, file_checksum,
                                                     save_atomically)
    from megatron_dcp.runtime.checkpoint_verify import verify_checkpoint

    root = tmp_path / "ckpt"

    def write(staging: str) -> None:  # no save_file: rank 0 reads the file back
        (root / staging).mkdir()
        (root / staging / "plain.bin").write_bytes(b"abc" * 1000)

    save_atomically(str(root), "iter_1", write)
    _, manifest = verify_checkpoint(str(root))
    assert manifest["checksums"] == {"plain.bin": file_checksum(str(root / "iter_1/plain.bin"))}
    _flip(root / "iter_1" / "plain.bin", 10, 1)
    with pytest.raises(CheckpointError, match="the checksum of plain.bin"):
        verify_checkpoint(str(root), "iter_1")


def _two_ranks(rank: int, world_size: int, root: str) -> tuple:
    import torch.distributed as dist

    from megatron_dcp.runtime.checkpoint_verify import verify_checkpoint

    for step in (1, 2):
        _save(Path(root), step, rank=rank)
    dist.barrier()
    if rank == 0:  # rank 1's shard: only one rank checksums it, every rank must refuse it
        _flip(Path(root, "iter_2", "rank_1.pt"), 200)
    dist.barrier()
    tag, manifest = verify_checkpoint(root)
    return tag, sorted(manifest.get("checksums", {}))


@pytest.mark.slow
def test_a_corrupt_shard_stops_every_rank_alike(tmp_path):
    for tag, names in run_distributed(_two_ranks, world_size=2, args=(str(tmp_path),)):
        assert tag == "iter_1" and names == ["rank_0.pt", "rank_1.pt"]


def test_keep_last_keeps_the_newest_verified_checkpoint(tmp_path):
    """The hook for a non-finite-step guard: checkpoints saved ``verified=False`` never push
    the newest verified one out."""
    root = tmp_path / "ckpt"
    _save(root, 1)
    for step in (2, 3, 4):
        _save(root, step, keep_last=1, verified=False)
    assert sorted(p.name for p in root.iterdir()) == ["iter_1", "iter_4", "latest"]
    _save(root, 5, keep_last=1)  # a verified one again: the old one may go
    assert sorted(p.name for p in root.iterdir()) == ["iter_5", "latest"]


def test_latest_may_name_only_a_checkpoint_in_its_directory(tmp_path):
    from megatron_dcp.runtime.checkpoint_dir import CheckpointError
    from megatron_dcp.runtime.checkpoint_verify import verify_checkpoint

    _save(tmp_path / "other", 2)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest").write_text("../other/iter_2\n")
    with pytest.raises(CheckpointError, match=r"names '../other/iter_2': a latest file may name "
                                              "only a checkpoint inside its own directory"):
        verify_checkpoint(str(tmp_path / "ckpt"))


def test_full_disk_is_named_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    from megatron_dcp.runtime import checkpoint_dir
    from megatron_dcp.runtime.checkpoint_dir import CheckpointError, read_latest

    root = tmp_path / "ckpt"
    _save(root, 1)

    def no_space(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_dir.ChecksumWriter, "write", no_space)
    with pytest.raises(CheckpointError) as err:
        _save(root, 2)
    assert "rank 0: the disk is full" in str(err.value)
    assert "[Errno 28] No space left on device" in str(err.value)  # not torch's "unexpected pos"
    monkeypatch.undo()

    def short_write(*args, **kwargs):  # what torch.save(obj, path) raises on a full disk
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", short_write)
    with pytest.raises(CheckpointError, match="rank 0: the disk is full .*unexpected pos"):
        _save(root, 3)
    assert read_latest(str(root)) == "iter_1"
    assert sorted(p.name for p in root.iterdir()) == ["iter_1", "latest"]  # nothing half-kept


def test_save_dir_is_checked_at_start(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "examples"))
    import pretrain_megatron
    import training

    from megatron_dcp.runtime.checkpoint_dir import CheckpointError, check_save_dir

    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = [(str(afile), "is a file: give a directory"),
             (str(afile / "ckpt"), f"lies under {afile}, which is a file"),
             ("/proc/megatron-dcp-test/ckpt", "is not writable")]  # refused even to root
    for path, message in cases:
        with pytest.raises(CheckpointError, match=message):
            check_save_dir(path)
        with pytest.raises(SystemExit):
            pretrain_megatron.parse_args(["--save", path])
        assert f"argument --save: checkpoint directory {path} {message}" in \
            capsys.readouterr().err
        p, g = training.argument_parser("test")
        training.add_checkpoint_flags(g, load_help="", timeout_help="")
        with pytest.raises(SystemExit):
            p.parse_args(["--save", path])
        assert f"argument --save: checkpoint directory {path} {message}" in \
            capsys.readouterr().err
    check_save_dir(str(tmp_path / "new" / "ckpt"))  # created, and nothing left in it
    assert list((tmp_path / "new" / "ckpt").iterdir()) == []
    assert p.parse_args(["--save", str(tmp_path)]).save == str(tmp_path)


# ---------------------------------------------------------------------- the Megatron example
class _Payload:
    """Unpickling this runs code (creates a file): what ``weights_only=True`` refuses."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _megatron(flags: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "1", str(MEGATRON), "--calculate-per-token-loss", "--global-batch-tokens", "1024",
           "--seq-length", "256", "--num-layers", "1", "--hidden-size", "32",
           "--num-attention-heads", "4", "--dcp", "--quiet", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)


def _reseal(checkpoint: Path) -> None:
    """Record the files' current sizes and checksums in the manifest (a crafted checkpoint
    passes the integrity check: only ``weights_only`` stops it)."""
    from megatron_dcp.runtime.checkpoint_dir import MANIFEST, file_checksum

    manifest = json.loads((checkpoint / MANIFEST).read_text())
    for name in manifest["files"]:
        manifest["files"][name] = (checkpoint / name).stat().st_size
        manifest.setdefault("checksums", {})[name] = file_checksum(str(checkpoint / name))
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_megatron_example_checkpoints_load_weights_only(tmp_path):
    ckpt = tmp_path / "ckpt"
    done = _megatron(["--train-iters", "2", "--save-interval", "1", "--save", str(ckpt)])
    assert done.returncode == 0, done.stderr[-3000:]
    shard = ckpt / "iter_2" / "rank_0.pt"
    state = torch.load(shard, weights_only=True)  # model, optimizer, sampler, planner state
    assert state["iteration"] == 2 and state["extra"]["planner"]["hardware"]
    original = shard.read_bytes()

    marker = tmp_path / "ran"  # a crafted file: refused, naming it, and nothing runs
    torch.save({"model": _Payload(str(marker))}, shard)
    _reseal(ckpt / "iter_2")
    done = _megatron(["--train-iters", "3", "--load", str(ckpt)])
    assert done.returncode != 0 and not marker.exists()
    assert f"{shard} is not a checkpoint of megatron-dcp" in done.stderr

    shard.write_bytes(original)  # same size, 64 bytes flipped: latest falls back to iter_1
    _reseal(ckpt / "iter_2")
    _flip(shard, len(original) // 2)
    done = _megatron(["--train-iters", "2", "--load", str(ckpt), "--log-json",
                      str(tmp_path / "log.jsonl")])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "iter_2 is corrupt: the checksum of rank_0.pt" in done.stderr
    assert f"loading {ckpt / 'iter_1'} instead" in done.stderr
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows if r] == [2]  # resumed after iteration 1


class _Payload:
    """Unpickling this creates the file ``marker``: code from the file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_file_the_manifest_does_not_list_is_refused_by_name(tmp_path, capsys):
    """A crafted shard added to a checkpoint folder after its save (a universal conversion, which
    reads every shard of the folder, would unpickle it): the checkpoint is refused naming the
    file, on the DeepSpeed plugin's load at another world size too, and the file never runs."""
    from megatron_dcp.runtime.checkpoint_dir import CheckpointError
    from megatron_dcp.runtime.checkpoint_verify import verify_checkpoint

    root = tmp_path / "ckpt"
    for step in (1, 2):
        _save(root, step)
    marker = tmp_path / "ran"
    crafted = root / "iter_2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": _Payload(str(marker))}, crafted)
    with pytest.raises(CheckpointError, match="holds files its dcp_manifest.json does not list: "
                                              "zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        verify_checkpoint(str(root), "iter_2")
    # through ``latest``: the newest checkpoint without a stranger is loaded, saying why
    assert verify_checkpoint(str(root))[0] == "iter_1"
    assert "does not list" in capsys.readouterr().err
    pytest.importorskip("deepspeed")
    from deepspeed_plugin import checkpoint as ds_checkpoint

    class Engine:  # saved at world 1 (ZeRO 1 here), loaded at world 2: a universal conversion
        world_size, zero_stage, rank = 2, 1, 0

    manifest = json.loads((root / "iter_2" / "dcp_manifest.json").read_text())
    manifest.update(world_size=1, zero_stage=1)
    (root / "iter_2" / "dcp_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        ds_checkpoint.load(Engine(), str(root), "iter_2")
    assert not marker.exists()
    assert not (root / "iter_2.universal").exists()
    crafted.unlink()  # the check is what refused it: without the stranger, the manifest passes
    assert verify_checkpoint(str(root), "iter_2")[0] == "iter_2"


def test_a_save_never_takes_over_another_runs_checkpoints(tmp_path):
    """Another run's ``iter_1..iter_3`` in the ``--save`` folder: refused at start unless this
    run resumes the newest of them from that folder; and should a save land among newer
    checkpoints anyway, ``latest`` does not move back and pruning keeps the newer ones."""
    from megatron_dcp.runtime.checkpoint_verify import takeover_problem

    root = tmp_path / "ckpt"
    for step in (1, 2, 3):
        _save(root, step, meta={"iteration": step})
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    problem = takeover_problem(str(root), None)
    assert "holds another run's checkpoints (iter_1, iter_2, iter_3; latest: iter_3)" in problem
    assert f"--load {root}" in problem
    assert "another run's" in takeover_problem(str(root), str(tmp_path / "elsewhere"))
    assert takeover_problem(str(root), str(root)) == ""  # resuming it: its own checkpoints
    assert takeover_problem(str(root), str(root / "iter_3")) == ""
    assert "holds newer checkpoints of that run (iter_3)" in takeover_problem(
        str(root), str(root / "iter_2"))
    assert takeover_problem(str(tmp_path / "new"), None) == ""
    assert takeover_problem(str(tmp_path), None) == ""  # a folder of no checkpoints
    # a save of iteration 2 that got through: latest stays on iter_3, iter_3 is not pruned
    # (iter_1, older than the one written, is)
    _save(root, 2, meta={"iteration": 2}, keep_last=1)
    assert (root / "latest").read_text().strip() == "iter_3"
    assert sorted(p.name for p in root.iterdir()) == ["iter_2", "iter_3", "latest"]
    assert all(p.read_bytes() == data for p, data in before.items() if "iter_3" in str(p))
