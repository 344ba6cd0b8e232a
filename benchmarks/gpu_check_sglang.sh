#!/usr/bin/env bash
# GPU checks of the SGLang serving path (issue 32), for a lent accelerator machine (run
# through the device tool, from the repo root; about 3 minutes):
#   1. incremental HSTU over a paged K/V pool on the GPU (benchmarks/paged_check.py): the
#      bf16 pool against the fp32 one (relative error of new tokens' and candidates' outputs)
#      and the time of one step at 64 users x 4,000 cached events, 3 new, 200 candidates;
#   2. the same at a small ragged shape (block edges, a history not a multiple of anything).
# Not checked here: the SGLang engine itself on the GPU. The device image has no SGLang and
# cannot download it, and GenRecHSTU keeps its slot times and output rows on the CPU (see
# benchmarks/notes/2026-12-03-sglang-stateful.md for what a GPU run needs).
# Results land in $OUT (or ./gpu-out): paged.json and the logs.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
timeout 240 python3 -m genrec.benchmarks.paged_check --device cuda 2>&1 | tee "$OUT/paged.json"
timeout 60 python3 -m genrec.benchmarks.paged_check --device cuda --users 3 --history 257 --new 5 --candidates 7 \
    2>&1 | tee "$OUT/paged_small.json"
