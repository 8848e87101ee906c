"""examples/pretrain_megatron.py --ckpt-format torch_dist: Megatron's distributed checkpoint of
model and distributed optimizer, saved at DP 2 x PP 2 (4 ranks, gloo), resumes at DP 2 x PP 2
and, resharded, at DP 1 x PP 2 (2 ranks) with the losses of the uninterrupted run; a corrupt
file is found by its checksum before anything is loaded. With virtual pipeline stages (2 ranks)
both formats save every model chunk and resume with the uninterrupted losses; torch_dist also
without virtual stages (its layer keys are global)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from test_megatron_example import EXAMPLE, ROOT, _env, _train
from test_megatron_example_pp import COMMON

FLAGS = [*COMMON, "--train-iters", "4", "--dcp", "--use-distributed-optimizer",
         "--ckpt-format", "torch_dist"]


def _flip(path, offset: int, count: int = 16) -> None:
    data = bytearray(path.read_bytes())
    data[offset:offset + count] = bytes(b ^ 0xFF for b in data[offset:offset + count])
    path.write_bytes(bytes(data))


@pytest.mark.timeout(400)
def test_torch_dist_resumes_resharded_with_the_uninterrupted_losses(tmp_path, capsys):
    from megatron_dcp.runtime.checkpoint_dir import MANIFEST, verify_checkpoint

    ckpt = tmp_path / "ckpt"
    # the uninterrupted run saves after iterations 2 and 4
    full = _train(tmp_path, "full", ["--save", str(ckpt), "--save-interval", "2"], FLAGS, 4)
    assert [r["iteration"] for r in full] == [1, 2, 3, 4]
    files = (ckpt / "iter_2" / MANIFEST).read_text()
    assert ".distcp" in files and "state.pt" in files  # Megatron's files are checksummed too
    same = _train(tmp_path, "dp2", ["--load", str(ckpt / "iter_2")], FLAGS, 4)

    # a same-size corruption of Megatron's tensor file in latest (iter_4): found before load
    shard = sorted((ckpt / "iter_4").glob("*.distcp"))[0]
    _flip(shard, shard.stat().st_size // 2)
    assert verify_checkpoint(str(ckpt))[0] == "iter_2"
    said = capsys.readouterr().err
    assert f"iter_4 is corrupt: the checksum of {shard.name}" in said
    assert f"loading {ckpt / 'iter_2'} instead" in said
    # DP 1 x PP 2 loads latest: iter_4 fails its checksum, so iter_2 is resumed, resharded
    fewer = _train(tmp_path, "dp1", ["--load", str(ckpt)], FLAGS, 2)
    for resumed in (same, fewer):
        assert [r["iteration"] for r in resumed] == [3, 4]
        for a, b in zip(resumed, full[2:]):
            assert a["tokens"] == b["tokens"]
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)



# PP 2 x 2 virtual stages on 2 ranks (DP 1): 4 layers, chunks of one layer (rank 0: layers 0, 2)
VPP = [*COMMON, "--dcp", "--num-layers", "4", "--train-iters", "3"]
CHUNKS = ["--virtual-pipeline-model-parallel-size", "2"]


def _same_losses(resumed: list[dict], full: list[dict]) -> None:
    assert [r["iteration"] for r in resumed] == [3]
    assert resumed[0]["tokens"] == full[2]["tokens"]
    assert abs(resumed[0]["loss"] - full[2]["loss"]) <= 1e-5 * abs(full[2]["loss"])


@pytest.mark.timeout(400)
def test_torch_dist_virtual_stages_resume_and_remap_layers(tmp_path):
    """Every chunk saved (``model0``, ``model1``) with global layer keys: a resume with the same
    chunks, and one without virtual stages (rank 0 then holds layers 0 and 1, not 0 and 2;
    Megatron's fp32 optimizer, whose states follow the model's tensors), continue the
    uninterrupted losses."""
    from torch.distributed.checkpoint import FileSystemReader

    flags, ckpt = [*VPP, "--ckpt-format", "torch_dist"], tmp_path / "ckpt"
    full = _train(tmp_path, "full", [*CHUNKS, "--save", str(ckpt), "--save-interval", "2"],
                  flags, 2)
    assert [r["iteration"] for r in full] == [1, 2, 3]
    saved = FileSystemReader(str(ckpt / "iter_2")).read_metadata().state_dict_metadata
    assert saved["decoder.layers.self_attention.linear_qkv.weight"].size[0] == 4  # all layers
    _same_losses(_train(tmp_path, "same", [*CHUNKS, "--load", str(ckpt / "iter_2")], flags, 2),
                 full)
    _same_losses(_train(tmp_path, "plain", ["--load", str(ckpt / "iter_2")], flags, 2), full)


@pytest.mark.timeout(400)
def test_per_rank_format_virtual_stages_resume_and_refuse_another_count(tmp_path):
    """The per-rank format holds every chunk's state; the manifest records the virtual stages,
    and a load with another count is refused by name."""
    from megatron_dcp.runtime.checkpoint_dir import MANIFEST

    ckpt = tmp_path / "ckpt"
    full = _train(tmp_path, "full", [*CHUNKS, "--save", str(ckpt), "--save-interval", "2"], VPP,
                  2)
    assert json.loads((ckpt / "iter_2" / MANIFEST).read_text())["virtual_pipeline"] == 2
    _same_losses(_train(tmp_path, "same", [*CHUNKS, "--load", str(ckpt / "iter_2")], VPP, 2),
                 full)
    other = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc_per_node", "2", str(EXAMPLE), *VPP, "--load", str(ckpt)],
                           cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=150)
    assert other.returncode != 0
    assert "virtual_pipeline=2 (this run: 1)" in other.stderr, other.stderr[-3000:]
