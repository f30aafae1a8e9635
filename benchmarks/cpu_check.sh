#!/usr/bin/env bash
# Issue 36's measurements on a CPU, as one prepared run for a quiet session (the Xeon with AMX still lacks
# most of them: benchmarks/RESULTS.md says which). Each benchmark runs under the lock, one after the other,
# with what it prints kept in $LOGS/<name>.log (default benchmarks/logs-<date>, git-ignored).
#
#   bash benchmarks/cpu_check.sh quick     # decoding, prefill and training against transformers and llama.cpp
#                                          # (~25 min on 2 cores)
#   bash benchmarks/cpu_check.sh chapters  # the book's chapters 5, 6 and 7 against the book's own code
#                                          # (~70 min on 2 cores; chapter 7's inputs are written first)
#   bash benchmarks/cpu_check.sh all
#
# Needs the test extras (transformers, the book's package, llama-cpp-python built for this CPU) and
# ../shared/data for the chapters. Stop anything else first: the host's own noise is 10-40%.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
part="${1:-quick}"
LOGS="${LOGS:-benchmarks/logs-$(date -u +%Y%m%d-%H%M)}"
mkdir -p "$LOGS"
lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-160 | tee "$LOGS/machine.log"

bench() {  # bench NAME SCRIPT ARGS...
  local name="$1"; shift
  echo "== $name: python benchmarks/$*" | tee -a "$LOGS/summary.log"
  flock /tmp/glassgpt-bench.lock python "benchmarks/$@" 2>&1 | tee "$LOGS/$name.log" | tail -25
  echo "   rc ${PIPESTATUS[0]}" | tee -a "$LOGS/summary.log"
}

quick() {
  bench llamacpp bench_llamacpp.py --compile --threads 2 --repeats 3          # point 1 and 2: vs llama.cpp, share of bandwidth
  bench generate bench_generate.py --compile --threads 2 --batch 1 --int4 --repeats 3
  bench prefill bench_prefill.py --compile --threads 2 --repeats 3            # point 3: >= 1.3x transformers on the Xeon
  bench train bench_train_step.py --compile --threads 2 --repeats 3           # point 4: training >= 1.5x transformers bf16
  bench ab_pages ab_step.py pages                                             # 2 MB pages, paired in one process
  bench cold_start bench_cold_start.py --repeats 3 --no-hf                    # point 5: a reader's wait
}

chapters() {
  bench ch05 bench_book_ch05.py --skip-exact --threads 1                      # point 4: 0.25x the book's wall time
  bench ch06 bench_book_ch06.py --threads 2
  bench ch07 bench_book_ch07.py --skip-exact --responses 5 --threads 2
  bench floor_ch05 bench_matmul_floor.py --threads 1 --tokens 512             # what the CPU's products allow
  bench floor_ch07 bench_matmul_floor.py --threads 2 --tokens 466
}

case "$part" in
  quick) quick ;;
  chapters) chapters ;;
  all) quick; chapters ;;
  *) echo "usage: bash benchmarks/cpu_check.sh quick|chapters|all" >&2; exit 2 ;;
esac
echo "logs in $LOGS"
