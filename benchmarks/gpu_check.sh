#!/usr/bin/env bash
# GPU checks for a lent accelerator machine (run through the device tool, from the repo
# root; under 8 minutes). Needs only what that machine's image holds (python3 with CUDA
# torch + triton, pytest, numpy); nothing is installed or downloaded: benchmarks/gpu_check.py
# maps genrec.* to the repository's folders with a shim of symlinks (see its docstring).
#   1. the Triton kernel tests, compiled for the GPU;
#   2. HSTU attention fwd+bwd: reference vs torch.compile vs Triton (fp32 and bf16);
#   3. a bf16 training step of the HSTU tower on plain embeddings;
#   4. the fp8 weight-storage check of the dense path (quant/dense.py Fp8WeightLinear);
#   5. the paged-KV check (incremental HSTU over a bf16 vs fp32 K/V pool).
# Everything lands in $OUT (or ./gpu-out) as one gpu_check.json. `--dry-run` checks imports
# and arguments without CUDA (tests/test_gpu_check.py runs it in CI).
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt"
exec python3 benchmarks/gpu_check.py --out "$OUT" "$@"
