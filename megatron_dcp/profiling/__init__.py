"""Measuring this machine for the cost model: `profile_hardware` (the CLI is
``tools/profile_hardware.py``). Above the runtime and the reference models (it times real tasks
of the reference decoder); nothing in the library imports it.
"""

from megatron_dcp.profiling.hardware import ProfileSettings, profile_hardware

__all__ = ["ProfileSettings", "profile_hardware"]
