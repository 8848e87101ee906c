"""The main job on the embedded default (placeholder until the engine issues land: the simulator)."""
import subprocess
import sys

sys.exit(subprocess.call([sys.executable, "tools/simulate.py", "--gpus", "32", "--gpus-per-node", "8",
                          "--model", "llama-7b", "--hardware", "h200", "--dist", "short",
                          "--policy", "all"]))
