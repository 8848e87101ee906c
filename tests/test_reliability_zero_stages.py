"""DeepSpeed checkpoints across ZeRO stages (issue 31): a change between ZeRO 3 and ZeRO 1 (either
way) is refused at start naming both stages, before any universal conversion is written
(DeepSpeed 0.19's universal loader dies with a bare AssertionError in its state_dict_factory
there); ZeRO 1 -> 2 still loads; every load says once that DeepSpeed's loader unpickles fully,
after every file was read with ``weights_only=True``: a crafted optimizer shard (its manifest
resealed) is refused naming it, and its code never runs.
One DeepSpeed launch (1 rank) runs this file as the training script."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from distributed import launch_deepspeed

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--global-batch-tokens", "1024", "--seq-length", "256", "--num-layers", "1",
          "--hidden-size", "32", "--num-heads", "4", "--quiet", "--dcp"]


def test_stage_change_rule():
    from deepspeed_plugin.checkpoint import stage_change_refused

    assert stage_change_refused(1, 1) == stage_change_refused(1, 2) == ""
    assert stage_change_refused(2, 1) == "" and stage_change_refused(3, 3) == ""
    for saved, now in ((1, 3), (3, 1), (2, 3), (3, 2), (0, 1), (3, 0)):
        text = stage_change_refused(saved, now)
        assert f"saved at ZeRO {saved}; this run uses ZeRO {now}" in text
        assert f"--zero-stage {saved}" in text


def _job(work: str) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    import pretrain

    from megatron_dcp.runtime.checkpoint_dir import CheckpointError

    for stage in (1, 3):
        pretrain.main([*COMMON, "--zero-stage", str(stage), "--train-iters", "1", "--save",
                       os.path.join(work, f"zero{stage}")])
    for saved, now in ((1, 3), (3, 1), (1, 2)):
        try:
            pretrain.main([*COMMON, "--zero-stage", str(now), "--train-iters", "2", "--load",
                           os.path.join(work, f"zero{saved}")])
            said = "loaded"
        except CheckpointError as err:
            said = str(err)
        converted = os.path.exists(os.path.join(work, f"zero{saved}", "iter_1.universal"))
        with open(os.path.join(work, f"{saved}to{now}.txt"), "w") as f:
            f.write(f"{said}\nconverted: {converted}")
    # a crafted optimizer shard (manifest resealed): refused naming it, nothing runs
    import shutil

    import torch

    crafted = os.path.join(work, "crafted")
    shutil.copytree(os.path.join(work, "zero3"), crafted)
    shard = os.path.join(crafted, "iter_1", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    state = torch.load(shard, weights_only=False)  # our own file, trusted
    state["payload"] = Payload(os.path.join(work, "ran"))
    torch.save(state, shard)
    _reseal(os.path.join(crafted, "iter_1"))
    try:
        pretrain.main([*COMMON, "--zero-stage", "3", "--train-iters", "2", "--load", crafted])
        said = "loaded"
    except CheckpointError as err:
        said = str(err)
    with open(os.path.join(work, "crafted.txt"), "w") as f:
        f.write(said)


class Payload:
    """Unpickling this creates the file ``marker``: code from the file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _reseal(checkpoint: str) -> None:
    """The manifest updated as whoever crafted the files would."""
    import json

    from megatron_dcp.runtime.checkpoint_dir import MANIFEST, file_checksum

    with open(os.path.join(checkpoint, MANIFEST)) as f:
        manifest = json.load(f)
    for name in manifest["files"]:
        manifest["files"][name] = os.path.getsize(os.path.join(checkpoint, name))
        manifest["checksums"][name] = file_checksum(os.path.join(checkpoint, name))
    with open(os.path.join(checkpoint, MANIFEST), "w") as f:
        json.dump(manifest, f)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_zero_1_3_changes_are_refused_naming_both_stages(tmp_path):
    proc = launch_deepspeed(1, [__file__, "--work", str(tmp_path)], 360)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for saved, now in ((1, 3), (3, 1)):
        said = (tmp_path / f"{saved}to{now}.txt").read_text()
        assert f"was saved at ZeRO {saved}; this run uses ZeRO {now}" in said, said
        assert f"resume with --zero-stage {saved}" in said
        # refused before DeepSpeed's converter wrote anything
        assert said.endswith("converted: False")
    assert (tmp_path / "1to2.txt").read_text() == "loaded\nconverted: True"
    out = proc.stdout + proc.stderr
    assert out.count("then DeepSpeed's loader unpickles them fully") == 1  # the one load
    crafted = (tmp_path / "crafted.txt").read_text()
    shard = tmp_path / "crafted" / "iter_1" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert f"{shard} is not a checkpoint of megatron-dcp: it asks for io.open" in crafted, crafted
    assert not (tmp_path / "ran").exists()


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--work", required=True)
    a = p.parse_args()
    try:
        _job(a.work)
    finally:
        from megatron_dcp.runtime.groups import destroy_process_groups

        destroy_process_groups()
