"""examples/pretrain_megatron.py --ckpt-format torch_dist: Megatron's distributed checkpoint of
model and distributed optimizer, saved at DP 2 x PP 2 (4 ranks, gloo), resumes at DP 2 x PP 2
and, resharded, at DP 1 x PP 2 (2 ranks) with the losses of the uninterrupted run; a corrupt
file is found by its checksum before anything is loaded. With virtual pipeline stages (2 ranks)
both formats save every model chunk and resume with the uninterrupted losses; torch_dist also
without virtual stages (its layer keys are global).

One launch per world size (the 4-rank one first: the 2-rank one resumes its checkpoint) calls
the example's ``main`` once per run, in order; each test reads the runs it names, and a run that
raises fails the tests that read it, not the runs after it (as tests/test_megatron.py)."""

from __future__ import annotations

import json

import pytest

from distributed import run_distributed
from test_megatron_example import EXAMPLE
from test_megatron_example_pp import COMMON

pytestmark = pytest.mark.slow  # every test here launches processes

FLAGS = [*COMMON, "--train-iters", "4", "--dcp", "--use-distributed-optimizer",
         "--ckpt-format", "torch_dist"]
# PP 2 x 2 virtual stages on 2 ranks (DP 1): 4 layers, chunks of one layer (rank 0: layers 0, 2)
VPP = [*COMMON, "--dcp", "--num-layers", "4", "--train-iters", "3"]
CHUNKS = ["--virtual-pipeline-model-parallel-size", "2"]
TORCH_DIST = [*VPP, "--ckpt-format", "torch_dist"]


def _runs(work) -> dict[int, dict[str, list[str]]]:
    """World size -> run name -> the example's flags (``--log-json`` added per run), in the
    order they run: a save before the loads of its checkpoint."""
    resharded, dist_vpp, per_rank = work / "resharded", work / "dist_vpp", work / "per_rank"
    return {
        # the uninterrupted run saves after iterations 2 and 4
        4: {"full": [*FLAGS, "--save", str(resharded), "--save-interval", "2"],
            "dp2": [*FLAGS, "--load", str(resharded / "iter_2")]},
        # DP 1 x PP 2 loads latest (iter_4, corrupted in between: `_corrupt_latest`)
        2: {"dp1": [*FLAGS, "--load", str(resharded)],
            "dist_vpp_full": [*TORCH_DIST, *CHUNKS, "--save", str(dist_vpp), "--save-interval",
                              "2"],
            "dist_vpp_same": [*TORCH_DIST, *CHUNKS, "--load", str(dist_vpp / "iter_2")],
            "dist_vpp_plain": [*TORCH_DIST, "--load", str(dist_vpp / "iter_2")],
            "rank_vpp_full": [*VPP, *CHUNKS, "--save", str(per_rank), "--save-interval", "2"],
            "rank_vpp_same": [*VPP, *CHUNKS, "--load", str(per_rank / "iter_2")],
            "rank_vpp_other": [*VPP, "--load", str(per_rank)]},
    }


def _run_all(rank: int, world_size: int, runs: dict[str, list[str]], work: str) -> dict:
    """Every run of ``runs`` through the example's ``main`` in this launch, one after another;
    returns {name: (True, (stdout, log records)) or (False, traceback)} (rank 0's stdout and
    records; others' empty): a run that raises does not stop the next."""
    import contextlib
    import io
    import multiprocessing
    import os
    import sys
    import traceback
    import warnings

    from megatron_dcp.megatron.parallel import destroy_model_parallel

    warnings.filterwarnings("ignore")
    # Megatron's torch_dist save writes from forked processes, which a daemonic rank may not
    # start (torchrun's ranks are not daemons either); the launch still ends every rank
    multiprocessing.current_process().daemon = False
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    sys.path.insert(0, str(EXAMPLE.parent))
    import pretrain_megatron

    out = {}
    for name, flags in runs.items():
        log, stdout = os.path.join(work, f"{name}.jsonl"), io.StringIO()
        try:
            with contextlib.redirect_stdout(stdout):
                code = pretrain_megatron.main([*flags, "--log-json", log])
            assert code == 0, f"main returned {code}"
            records = [] if rank else [json.loads(line) for line in open(log)]
            out[name] = True, (stdout.getvalue(), records)
        except Exception:  # noqa: BLE001 - reported under the run's name
            out[name] = False, traceback.format_exc()
        finally:
            destroy_model_parallel()  # the next run initialises Megatron's groups afresh
    return out


def _flip(path, offset: int, count: int = 16) -> None:
    data = bytearray(path.read_bytes())
    data[offset:offset + count] = bytes(b ^ 0xFF for b in data[offset:offset + count])
    path.write_bytes(bytes(data))


def _corrupt_latest(work):
    """A same-size corruption of Megatron's tensor file in latest (iter_4); returns the file."""
    shard = sorted((work / "resharded" / "iter_4").glob("*.distcp"))[0]
    _flip(shard, shard.stat().st_size // 2)
    return shard


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """``run(name)``: rank 0's (stdout, log records) of that run, ``refusal(name)``: every rank's
    traceback of a run that must fail; ``work``: the runs' directory, ``corrupted``: the file
    `_corrupt_latest` changed after the 4-rank launch. Each world size launches once."""
    work = tmp_path_factory.mktemp("dist_ckpt")
    runs, done = _runs(work), {}
    state = {"work": work}

    def launched(name):
        world_size = next(w for w, named in runs.items() if name in named)
        for w in runs:  # in order: each launch after those it loads from
            if w not in done:
                if w == 2:
                    state["corrupted"] = _corrupt_latest(work)
                done[w] = run_distributed(_run_all, world_size=w, timeout_s=380,
                                          args=(runs[w], str(work)))
            if w == world_size:
                return [out[name] for out in done[w]]

    def run(name):
        results = launched(name)
        failed = {r: tb for r, (ok, tb) in enumerate(results) if not ok}
        if failed:
            pytest.fail(f"run {name}: " + "".join(f"\n--- rank {r} ---\n{tb}"
                                                  for r, tb in failed.items()))
        stdout, records = results[0][1]
        assert "done:" in stdout, stdout
        return records

    def refusal(name):
        results = launched(name)
        assert not any(ok for ok, _ in results), f"run {name} was not refused"
        return [tb for _, tb in results]

    state.update(run=run, refusal=refusal)
    return state


@pytest.mark.timeout(400)
def test_torch_dist_resumes_resharded_with_the_uninterrupted_losses(launches, capsys):
    from megatron_dcp.runtime.checkpoint_dir import MANIFEST
    from megatron_dcp.runtime.checkpoint_verify import verify_checkpoint

    run, ckpt = launches["run"], launches["work"] / "resharded"
    full = run("full")
    assert [r["iteration"] for r in full] == [1, 2, 3, 4]
    files = (ckpt / "iter_2" / MANIFEST).read_text()
    assert ".distcp" in files and "state.pt" in files  # Megatron's files are checksummed too
    same = run("dp2")
    # DP 1 x PP 2 loads latest: iter_4 fails its checksum, so iter_2 is resumed, resharded
    fewer = run("dp1")
    # the corruption of iter_4 (a same-size change of a tensor file): found before load
    shard = launches["corrupted"]
    assert verify_checkpoint(str(ckpt))[0] == "iter_2"
    said = capsys.readouterr().err
    assert f"iter_4 is corrupt: the checksum of {shard.name}" in said
    assert f"loading {ckpt / 'iter_2'} instead" in said
    for resumed in (same, fewer):
        assert [r["iteration"] for r in resumed] == [3, 4]
        for a, b in zip(resumed, full[2:]):
            assert a["tokens"] == b["tokens"]
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)


def _same_losses(resumed: list[dict], full: list[dict]) -> None:
    assert [r["iteration"] for r in resumed] == [3]
    assert resumed[0]["tokens"] == full[2]["tokens"]
    assert abs(resumed[0]["loss"] - full[2]["loss"]) <= 1e-5 * abs(full[2]["loss"])


@pytest.mark.timeout(400)
def test_torch_dist_virtual_stages_resume_and_remap_layers(launches):
    """Every chunk saved (``model0``, ``model1``) with global layer keys: a resume with the same
    chunks, and one without virtual stages (rank 0 then holds layers 0 and 1, not 0 and 2;
    Megatron's fp32 optimizer, whose states follow the model's tensors), continue the
    uninterrupted losses."""
    from torch.distributed.checkpoint import FileSystemReader

    run, ckpt = launches["run"], launches["work"] / "dist_vpp"
    full = run("dist_vpp_full")
    assert [r["iteration"] for r in full] == [1, 2, 3]
    saved = FileSystemReader(str(ckpt / "iter_2")).read_metadata().state_dict_metadata
    assert saved["decoder.layers.self_attention.linear_qkv.weight"].size[0] == 4  # all layers
    _same_losses(run("dist_vpp_same"), full)
    _same_losses(run("dist_vpp_plain"), full)


@pytest.mark.timeout(400)
def test_per_rank_format_virtual_stages_resume_and_refuse_another_count(launches):
    """The per-rank format holds every chunk's state; the manifest records the virtual stages,
    and a load with another count is refused by name."""
    from megatron_dcp.runtime.checkpoint_dir import MANIFEST

    run, ckpt = launches["run"], launches["work"] / "per_rank"
    full = run("rank_vpp_full")
    assert json.loads((ckpt / "iter_2" / MANIFEST).read_text())["virtual_pipeline"] == 2
    _same_losses(run("rank_vpp_same"), full)
    for said in launches["refusal"]("rank_vpp_other"):
        assert "virtual_pipeline=2 (this run: 1)" in said, said[-3000:]
