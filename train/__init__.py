"""Training (``genrec train``, ``genrec eval``): one sub-package per part.

    data/     interaction logs: schema, Parquet reading, synthetic data, conversion, checks
    loop/     launch a job, parallelize, the training loop, checkpoints, weight averaging
    eval/     full-corpus retrieval metrics, ranking metrics, calibration, baselines
    observe/  the run's log, step-time accounting, profiles, diagnoses, the watchdog, faults
    runs/     run directories and ``genrec runs list | show | compare``

``job`` is the job config every part reads its own section of; ``cli`` holds the command
handlers; ``sid_build`` is ``genrec sid build``.
"""
