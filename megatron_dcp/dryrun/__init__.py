"""A dry run of a real-size DCP job on a CPU: every rank, one after another, on the meta device
under torch's fake process group, with every collective recorded and checked across ranks
(`megatron_dcp.dryrun.record`; the command: ``python -m megatron_dcp.dryrun``, docs/DRYRUN.md).
Nothing of training imports it."""
