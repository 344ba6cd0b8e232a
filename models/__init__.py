"""Towers and heads: single-process model code (no torch.distributed, gRPC or SGLang)."""
