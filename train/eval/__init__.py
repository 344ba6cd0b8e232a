"""Evaluation: full-corpus retrieval metrics, ranking-task metrics, calibration, baselines.

``evaluate`` ranks the whole catalogue per user (HR@K, NDCG@K, MRR); ``ranking_metrics``
scores the ranking head (AUC, GAUC, log loss, NE); ``calibrate`` fits the head's calibrator
after training; ``baselines`` are the non-neural references under the same protocol.
"""
