#!/usr/bin/env bash
# GPU checks for a lent accelerator machine (run through the device tool, from the repo
# root). Needs only what that machine's image holds (python3 with CUDA torch + triton,
# pytest); no torchrec, no data. Inside 10 minutes:
#   1. the Triton kernel tests, compiled for the GPU (fp32, bf16, fp16, all shapes);
#   2. HSTU attention fwd+bwd: reference vs torch.compile vs Triton (fp32 and bf16);
#   3. an fp8 weight-storage check of the dense path (quant/dense.py Fp8WeightLinear).
# Results land in $OUT (or ./gpu-out): test log, benchmarks/results/kernels_cuda.json.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))" | tee -a "$OUT/gpu.txt"
timeout 300 python3 -m pytest tests/test_kernels.py -q -p no:cacheprovider 2>&1 | tee "$OUT/kernel_tests.log"
timeout 240 python3 -m genrec.benchmarks.kernels --device cuda --no-train-step --rounds 5 --reps 20 2>&1 | tee "$OUT/kernels_bench.log"
cp benchmarks/results/kernels_cuda.json "$OUT/" 2>/dev/null
timeout 60 python3 - <<'PY' 2>&1 | tee "$OUT/fp8.log"
import torch
from genrec.quant.dense import Fp8WeightLinear, quantize_linear_weight
lin = torch.nn.Linear(1024, 1024).cuda()
x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
codes, scale = quantize_linear_weight(lin.weight.data, "fp8")
layer = Fp8WeightLinear(codes, scale, lin.bias.data).cuda()
ref = lin.to(torch.bfloat16)(x)
print("fp8 weight-only vs bf16 max rel err", ((layer(x) - ref).abs().max() / ref.abs().max()).item())
PY
