"""Test support shared by tests and benchmarks: tiny Hugging Face models, synthetic corpora."""
