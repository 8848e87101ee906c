"""examples/pretrain_megatron.py --ckpt-format torch_dist: Megatron's distributed checkpoint of
model and distributed optimizer, saved at DP 2 x PP 2 (4 ranks, gloo), resumes at DP 2 x PP 2
and, resharded, at DP 1 x PP 2 (2 ranks) with the losses of the uninterrupted run; a corrupt
file is found by its checksum before anything is loaded."""

from __future__ import annotations

import pytest

from test_megatron_example import _train
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
