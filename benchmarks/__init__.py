"""Benchmarks: scripts that measure and write JSON + benchmarks/RESULTS.md (never tests)."""
