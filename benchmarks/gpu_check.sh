#!/usr/bin/env bash
# The prepared GPU check (issue 13, point 6), for a session that is lent a GPU machine.
# One command, well inside a 10-minute device call; everything it prints lands in $OUT/gpu.log:
#   run(command="bash benchmarks/gpu_check.sh", timeout_s=580)
# It needs torch with CUDA (the device image has it), tiktoken, safetensors, numpy, tqdm and
# regex; transformers for the reference rows (skipped with --no-hf where absent).
set -uo pipefail
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="${OUT:-.}/gpu.log"
hf=$(python3 -c "import transformers" 2>/dev/null && echo "" || echo "--no-hf")
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  # Correctness on the GPU first (was a test that skipped on every CPU machine, CI included): a
  # random gpt2 on cuda against the same weights on the CPU, float32 logits within 1e-4.
  timeout 120 python3 -c "
import torch, glassgpt
from glassgpt.formats import random_model
cpu = random_model(glassgpt.PRESETS['gpt2'], torch.device('cpu'), torch.float32)
gpu = random_model(glassgpt.PRESETS['gpt2'], torch.device('cpu'), torch.float32).cuda()
gpu.load_state_dict(cpu.state_dict())
ids = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    err = (gpu(ids.cuda()).cpu() - cpu(ids)).abs().max().item()
print('cuda float32 logits vs the CPU: max abs difference', err, 'OK' if err < 1e-4 else 'FAIL')"
  # Training MFU for gpt2 at context 1024 (goal: >= 50%), eager and compiled.
  timeout 240 python3 benchmarks/bench_train_step.py --device cuda --model gpt2 --batch 8 --seq-len 1024 --compile $hf
  # Generation for gpt2 and gpt2-xl, batch 1 and 8.
  timeout 150 python3 benchmarks/bench_generate.py --device cuda --model gpt2 --batch 1 8 --compile $hf
  timeout 150 python3 benchmarks/bench_generate.py --device cuda --model gpt2-xl --batch 1 $hf
} 2>&1 | tee "$log"
