#!/usr/bin/env bash
# GPU checks of the SGLang serving path (issues 32 and 42), for a lent accelerator machine (run
# through the device tool, from the repo root; about 3 minutes): incremental HSTU over a
# paged K/V pool on the GPU (benchmarks/paged_check.py), the bf16 pool against the fp32 one
# (relative error of new tokens' and candidates' outputs) and the time of one step, at 64
# users x 4,000 cached events, 3 new, 200 candidates, and at a small ragged shape; at each shape
# also the attention op alone ("kernel"): the Triton kernel reading the pool in place through the
# slot map (kernels/hstu_paged_triton.py) against the reference's [B, L, H, D] gathers, its
# error and both times, fp32 and bf16 pools. It is the `paged` step of benchmarks/gpu_check.py
# (which also runs it), alone.
# Not checked here: the SGLang engine itself on the GPU. The device image has no SGLang and
# cannot download it, and SGLang's CUDA wheels (torch 2.14.1, sglang-kernel, flashinfer) do not
# fit the 64 MiB a call carries (see benchmarks/notes/2026-12-03-sglang-stateful.md).
# Results land in $OUT (or ./gpu-out) as gpu_check.json.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
exec python3 benchmarks/gpu_check.py --out "$OUT" --only paged --budget-s 240 "$@"
