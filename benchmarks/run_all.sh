#!/usr/bin/env bash
# Regenerate every benchmarks/results/*.json in one go, on one commit (each JSON records it), in the order that
# keeps timing figures away from the noise of the rest: the paired timings first, then the long emulated runs,
# then the benchmarks whose figures are counts, bytes or plans. Several hours of exclusive CPU on a 2-core host:
# run it on a quiet machine, commit first (a dirty tree is recorded as "+dirty").
#
#   bash benchmarks/run_all.sh                 # all of them (make bench-all)
#   bash benchmarks/run_all.sh zero3 memory    # only these (names below)
#
# Logs: $WHALE_BENCH_LOGS (default runs/bench_logs)/<name>.log; a failed benchmark is reported and the rest run.
# Afterwards: make report (renders docs/benchmarks.md and lists any result measured on other code).
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
LOGS=${WHALE_BENCH_LOGS:-runs/bench_logs}
R=benchmarks/results
mkdir -p "$LOGS"
export PYTHONPATH=src:. HF_HUB_OFFLINE=1
TUNING=gpt96_dp2_m2,gpt96_pp2_m2,gpt_pp2_m4_gpipe_pt,gpt_dp4_m4_vpt,gpt_pp4_m2_gpipe_vpt,gpt_dp2_zero1,\
gpt_pp2xdp2_zero1,gpt_dp4_zero2_ckpt,gpt_dp4_zero3,gpt_dp2_ckpt,gpt_pp2xdp2_ckpt_vpt,gpt_dp2_offload,gpt_dp2_bf16_pt,\
gpt_dp4_fp16_vpt,moe_dp2,moe_dp4_m2,mlp_dp2_m2_pt,mlp_pp4_m4_vpt,llama_dp2,llama_pp2_m2_pt  # the 8-rank ones left out

declare -A CMD=(
  [dp_overhead]="benchmarks/dp_overhead.py --nproc 2 --steps 30 --out $R/dp_overhead.json"
  [vs_torch_pipelining]="benchmarks/vs_torch_pipelining.py --out $R/vs_torch_pipelining.json"
  [zero3]="benchmarks/zero3.py --out $R/zero3.json"
  [pipeline_bubble]="benchmarks/pipeline_bubble.py --out $R/pipeline_bubble.json"
  [pipeline_bubble_schedules]="benchmarks/pipeline_bubble.py --stages 4 --micro-batches 8 --schedules 1F1B \
Interleaved1F1B ZB-H1 --steps 6 --warmup 2 --out $R/pipeline_bubble_schedules.json"
  [straggler]="benchmarks/straggler.py --runs 6 --out $R/straggler.json"
  [moe]="benchmarks/moe.py --out $R/moe.json"
  [moe_vs_dense]="benchmarks/moe_vs_dense.py --out $R/moe_vs_dense.json"
  [planner]="benchmarks/planner.py --skip heldout,tuning --out $R/planner.json"
  [planner_heldout]="benchmarks/planner.py --skip sim,scale,auto --merge --steps 5 --warmup 2 --tuning-runs $TUNING \
--out $R/planner.json"
  [heterogeneous]="benchmarks/heterogeneous.py --out $R/heterogeneous.json"
  [memory]="benchmarks/memory.py --budget 16e6 --largest-vocab 256 --dp-start 3 --best-start 376 \
--best-layouts data_parallel --out $R/memory.json"
  [elastic]="benchmarks/elastic.py --out $R/elastic.json"
  [published]="benchmarks/published.py --out $R/published.json"
  [paper_10t]="benchmarks/paper_10t.py --out $R/paper_10t.json"
  [sequence_parallel_memory]="benchmarks/sequence_parallel_memory.py --out $R/sequence_parallel_memory.json"
  [classification]="benchmarks/classification.py --out $R/classification.json"
  [exit_teardown]="benchmarks/exit_teardown.py --runs 20 --out $R/exit_teardown.json"
  [reliability]="benchmarks/reliability.py --runs 21 --out $R/reliability.json"
)
ORDER=(dp_overhead vs_torch_pipelining zero3 pipeline_bubble pipeline_bubble_schedules straggler moe moe_vs_dense
       planner planner_heldout heterogeneous memory elastic published paper_10t sequence_parallel_memory
       classification exit_teardown reliability)
ALL=("${ORDER[@]}")
[ $# -gt 0 ] && ORDER=("$@")
for name in "${ORDER[@]}"; do  # every name checked before anything runs (a typo is not found hours in)
  [ -n "${CMD[$name]:-}" ] || { echo "unknown benchmark '$name'; one of: ${ALL[*]}"; exit 2; }
done
failed=()
for name in "${ORDER[@]}"; do
  echo "$(date -u +%H:%M:%S) $name: $PY ${CMD[$name]}"
  start=$SECONDS
  if $PY ${CMD[$name]} >"$LOGS/$name.log" 2>&1; then
    echo "$(date -u +%H:%M:%S) $name: done in $((SECONDS - start)) s"
  else
    echo "$(date -u +%H:%M:%S) $name: FAILED after $((SECONDS - start)) s (see $LOGS/$name.log)"; failed+=("$name")
  fi
done
echo "next: make report (renders docs/benchmarks.md from the JSONs and lists any result measured on other code)"
[ ${#failed[@]} -eq 0 ] || { echo "failed: ${failed[*]}"; exit 1; }
