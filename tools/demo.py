"""The main job on the embedded default: GPT pretraining with DeepSpeed and ``--dcp`` on 2 ranks.

Runs ``deepspeed --num_gpus 2 examples/pretrain.py --dcp`` on the embedded corpus (Python
standard-library docstrings and sources, long-tailed, shipped in the package) with a small model
for 8 iterations. On a CPU it sets a memory budget per rank (``--dcp_memory_budget_gb 0.006``:
6 MiB of activations and model state; a CPU leaves no reserve for a CUDA context) that the longest documents (2048 tokens) do not fit on one rank:
the planner splits those over both ranks (sequence-parallel degree 2, recomputing layers where
even that does not fit) while it packs the short ones, so the plan printed on each line changes
with the batch. The cost model starts from ``--dcp_hardware auto`` (on a CPU: an uncalibrated
start) and calibrates itself online: each line shows the predicted step time next to the
measured one and the calibration's error, which falls within a few iterations. It ends by drawing
the run (``dcp-report runs/demo.jsonl``: runs/demo.png and runs/demo.html). Works on CPU
(gloo) and GPUs. Extra arguments are passed to examples/pretrain.py (e.g. ``--train-iters 20
--zero-stage 2``), but ``--master_port N`` (``make demo PORT=N``), which is the rendezvous port of
DeepSpeed's launcher (default: a free one).
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_dcp.runtime.ports import free_port  # noqa: E402


def main() -> int:
    """Launch the demo run; returns its exit code."""
    args = sys.argv[1:]
    port = str(free_port())
    if "--master_port" in args:  # DeepSpeed's launcher's flag, not the script's
        at = args.index("--master_port")
        if at + 1 >= len(args) or not args[at + 1].isdigit() or not 0 < int(args[at + 1]) < 65536:
            print("demo: --master_port needs a port number (1-65535), e.g. make demo PORT=29500",
                  file=sys.stderr)
            return 2
        port = args[at + 1]
        del args[at:at + 2]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
           "--master_port", port, "examples/pretrain.py", "--dcp",
           "--deepspeed_config", "examples/ds_config.json", "--train-iters", "8",
           "--seq-length", "2048", "--global-batch-tokens", "8192", "--num-layers", "2",
           "--hidden-size", "64", "--num-heads", "4", "--log-json", "runs/demo.jsonl",
           "--overwrite-log",
           "--save-profile", "runs/demo_hardware.json"]
    import torch

    if not torch.cuda.is_available():  # a GPU's budget leaves a 4 GB reserve: no budget there
        cmd += ["--dcp_memory_budget_gb", "0.006"]
    cmd += args
    (ROOT / "runs").mkdir(exist_ok=True)
    print("+ deepspeed --num_gpus 2 " + " ".join(cmd[cmd.index("examples/pretrain.py"):]),
          flush=True)
    code = subprocess.call(cmd, cwd=ROOT, env=env)
    if code == 0 and "--log-json" not in args:  # the run's picture: dcp-report
        from tools import report

        report.main([str(ROOT / "runs" / "demo.jsonl")])  # its paths, or how to get matplotlib
    return code


if __name__ == "__main__":
    sys.exit(main())
