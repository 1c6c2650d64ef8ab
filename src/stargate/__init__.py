"""Stargate: an LLM request router, its Pylon sidecar, a mock engine and a benchmark harness."""

__version__ = "0.1.0"
