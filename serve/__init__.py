"""gRPC server, batching and scheduling, engines (PyTorch default, SGLang)."""
