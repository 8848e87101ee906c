"""The main job on the embedded default: GPT pretraining with DeepSpeed and ``--dcp`` on 2 ranks.

Runs ``deepspeed --num_gpus 2 examples/pretrain.py --dcp`` on the embedded corpus (Python
standard-library docstrings and sources, long-tailed, shipped in the package) with a small model
for a few iterations: each line shows the plan (sequence-parallel degrees, micro-steps per rank,
checkpointed layers, predicted step time), the loss and tokens/s. Works on CPU (gloo) and GPUs.
On a machine without CUDA the planner's cost model needs this machine's numbers (the presets
describe GPUs): the first run measures them once with ``tools/profile_hardware.py --quick``
(~15 s) into runs/hardware_cpu.json and passes it as ``--dcp_hardware``. Extra arguments are
passed to examples/pretrain.py (e.g. ``--train-iters 20 --zero-stage 2``).
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    """Launch the demo run; returns its exit code."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
           "--master_port", str(free_port()), "examples/pretrain.py", "--dcp",
           "--deepspeed_config", "examples/ds_config.json", "--train-iters", "6",
           "--seq-length", "2048", "--global-batch-tokens", "8192", "--num-layers", "2",
           "--hidden-size", "64", "--num-heads", "4", "--log-json", "runs/demo.jsonl",
           *sys.argv[1:]]
    (ROOT / "runs").mkdir(exist_ok=True)
    import torch

    if not torch.cuda.is_available():
        profile = ROOT / "runs" / "hardware_cpu.json"
        if not profile.exists():
            print("+ python tools/profile_hardware.py --quick (this machine's cost-model "
                  "numbers, once)", flush=True)
            code = subprocess.call([sys.executable, "tools/profile_hardware.py", "--out",
                                    str(profile), "--device",
                                    "cpu", "--dtype", "float32", "--threads", "1", "--ranks", "2",
                                    "--hidden", "64", "--layers", "2", "--heads", "4", "--vocab",
                                    "257",
                                    "--quick"], cwd=ROOT, env=env)
            if code:
                return code
        cmd += ["--dcp_hardware", str(profile)]
    print("+ deepspeed --num_gpus 2 " + " ".join(cmd[cmd.index("examples/pretrain.py"):]),
          flush=True)
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
