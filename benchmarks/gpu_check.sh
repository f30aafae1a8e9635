#!/usr/bin/env bash
# The prepared GPU check (issue 36, point 6), for a session that is lent a GPU machine. Two parts, each
# well inside one device call (a session has 15 minutes of device time, each machine's start included):
#   run(command="bash benchmarks/gpu_check.sh train", timeout_s=330)      # checks + training MFU
#   run(command="bash benchmarks/gpu_check.sh generate", timeout_s=450)   # gpt2 and gpt2-xl generation
# (no argument: both, one after the other). Everything it prints lands in $OUT/gpu-<part>.log.
# It needs torch with CUDA (the device image has it), tiktoken, safetensors, numpy, tqdm and regex;
# transformers for the reference rows (skipped with --no-hf where absent).
set -uo pipefail
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
part="${1:-all}"
hf=$(python3 -c "import transformers" 2>/dev/null && echo "" || echo "--no-hf")
run_part() {
  case "$1" in
    train)
      nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
      python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
      # Training MFU for gpt2 at context 1024 (goal: >= 50%): bf16, compiled, flash attention through SDPA.
      timeout 200 python3 benchmarks/bench_train_step.py --device cuda --model gpt2 --batch 32 --seq-len 1024 \
        --repeats 5 --compile $hf
      # Correctness on the GPU (no CPU can run these): CUDA against the CPU, the decoding step's CUDA graph
      # against the eager engine (float32, bfloat16, compiled), and a first timing of each.
      timeout 110 python3 benchmarks/gpu_checks.py
      ;;
    generate)
      # Generation for gpt2 (batch 1 and 8) and gpt2-xl (batch 1): glassgpt with and without the CUDA graph
      # against transformers on the same GPU.
      # (each batch size its own process and timeout: one run of both ran out after batch 1, 2026-12-04)
      timeout 150 python3 benchmarks/bench_generate.py --device cuda --model gpt2 --batch 1 --compile $hf
      timeout 150 python3 benchmarks/bench_generate.py --device cuda --model gpt2 --batch 8 --compile $hf
      timeout 130 python3 benchmarks/bench_generate.py --device cuda --model gpt2-xl --batch 1 $hf
      ;;
  esac
}
for p in $([ "$part" = all ] && echo train generate || echo "$part"); do
  run_part "$p" 2>&1 | tee "${OUT:-.}/gpu-$p.log"
done
