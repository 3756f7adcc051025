"""Starling's vLLM integration: a worker extension that applies committed Starling versions
in place inside a running vLLM (docs/vllm.md), the patch-file format, and the state digest."""

__version__ = "0.1.0"
