"""Fast ops with pure-PyTorch references. Imports only torch (and triton, lazily)."""
