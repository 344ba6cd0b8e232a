"""Training: datasets, the training loop, checkpoints and parallelism (``genrec train``)."""
