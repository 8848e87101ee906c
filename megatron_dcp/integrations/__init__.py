"""Adapters for model libraries other than Megatron-core (Hugging Face Transformers: `hf`)."""
