"""Feature specs -> TorchRec tables; KeyedJaggedTensor in, jagged embeddings out."""

import logging

# TorchRec calls torch.fx's is_fx_tracing(), which logs a one-time deprecation warning
# aimed at torch.export users; it says nothing about our code.
logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
