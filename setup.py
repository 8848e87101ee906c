"""megatron-dcp: Data-Centric Parallel for Megatron-core and DeepSpeed."""

from setuptools import find_packages, setup

# torch is pinned by the Makefile (torch==2.13.0, the version tested) before
# this package is installed; a range here lets GPU users keep their CUDA build.
EXTRAS = {
    "deepspeed": ["deepspeed==0.19.8"],
    "megatron": ["megatron-core==0.16.1"],
    "hf": ["transformers>=5.24,<6"],  # depends on no torch: keeps the CPU/CUDA torch in place
    "test": ["pytest", "pytest-timeout", "hypothesis"],
    "plot": ["matplotlib"],
    "gpu": ["flash-attn"],
}
EXTRAS["all"] = sorted({p for k, v in EXTRAS.items() if k != "gpu" for p in v})

setup(
    name="megatron-dcp",
    version="0.1.0",
    description="Data-Centric Parallel (per-sequence SP degree, checkpointing and micro-steps) "
    "for Megatron-core and DeepSpeed",
    packages=find_packages(include=["megatron_dcp", "megatron_dcp.*", "deepspeed_plugin", "deepspeed_plugin.*"]),
    package_data={"megatron_dcp.data": ["corpus/*"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.1", "numpy", "packaging"],
    extras_require=EXTRAS,
)
