"""Run bookkeeping: what a run directory holds and how runs are listed and compared.

``directory`` creates a run's directory and writes its files (config, versions, metrics,
curves, results); ``browse`` is ``genrec runs list | show | compare`` over those directories.
"""
