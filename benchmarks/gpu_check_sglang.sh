#!/usr/bin/env bash
# GPU checks of the SGLang serving path (issue 32), for a lent accelerator machine (run
# through the device tool, from the repo root; about 3 minutes): incremental HSTU over a
# paged K/V pool on the GPU (benchmarks/paged_check.py), the bf16 pool against the fp32 one
# (relative error of new tokens' and candidates' outputs) and the time of one step, at 64
# users x 4,000 cached events, 3 new, 200 candidates, and at a small ragged shape. It is the
# `paged` step of benchmarks/gpu_check.py (which also runs it), alone.
# Not checked here: the SGLang engine itself on the GPU. The device image has no SGLang and
# cannot download it, and GenRecHSTU keeps its slot times and output rows on the CPU (see
# benchmarks/notes/2026-12-03-sglang-stateful.md for what a GPU run needs).
# Results land in $OUT (or ./gpu-out) as gpu_check.json.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
exec python3 benchmarks/gpu_check.py --out "$OUT" --only paged --budget-s 240 "$@"
