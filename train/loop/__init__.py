"""The training loop: launch a job, parallelize the model, step, checkpoint, average.

``launch`` builds a job (process group, run directory, model, readers) and hands it to
``trainer.Trainer``; ``parallel`` applies TorchRec model parallelism and DDP from outside;
``checkpoint`` saves and restores DCP checkpoints; ``average`` keeps the EMA of the weights.
"""
