"""The CPU harness: what lets megatron-core (`core`) and Megatron-LM's training package (`lm`)
run without CUDA, for tests, examples, CPU trials and the dry run. Nothing that runs on a GPU
imports it (``tests/test_import_cycles.py``); every change it makes goes through the registry
(`megatron_dcp.patching`)."""
