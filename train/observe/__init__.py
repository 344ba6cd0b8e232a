"""Observability of a training job: its log, where step time goes, profiles, diagnoses.

``logs`` routes messages (and library warnings) to ``RUN/train.log``; ``stepstats`` and
``profiling`` account for step time; ``diagnose`` names non-finite steps, spikes and
resumes; ``watchdog`` names the rank and collective a stalled step waits in; ``faults`` is
the one test hook that injects faults into a run.
"""
