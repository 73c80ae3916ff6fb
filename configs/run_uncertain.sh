#!/usr/bin/env bash
# The world-learned-from-reward experiment (docs/uncertain.md): one warm start
# per seed on the stale logs of configs/world_uncertain.yaml, then four RL arms of 200 steps
# from it: rehearse (EnvACE), frozen (the warm start plays the world), act_only (rehearse_coef 0),
# real (the real world answers). After each seed, the tables, the paired bootstrap and the
# figure of what is there (python -m scripts.compare --uncertain), so results land seed by seed.
#   bash configs/run_uncertain.sh [RESULTS]              # seeds 1 2 3 4 5 (default RESULTS: out/uncertain)
#   SEEDS=1 bash configs/run_uncertain.sh                 # the reduced variant
#   PARALLEL=1 bash configs/run_uncertain.sh results/uncertain_rehearse-real-frozen-act_only_seeds1-5
#                                 # made the experiment in results/; python -m scripts.compare --uncertain FOLDER remakes its tables
# NICE=15 runs every step under `nice -n 15` (a shared machine); PARALLEL=1 runs a seed's four
# arms at once; either one sets OMP_NUM_THREADS=1; each arm's output goes to $R/ARM-seedS.log.
# A run whose eval.json exists is kept, not redone (a second call continues with the seeds left);
# $R/timing.log gets each seed's start, end and seconds; each finished run gets lookups.json.
set -euo pipefail
cd "$(dirname "$0")/.."
R=${1:-out/uncertain}
run() { nice -n "${NICE:-0}" python "$@"; }
# one thread per process on a shared machine: measured here, the warm start under nice -n 15 ran at
# 0.02-0.03 steps/s with torch's default 2 threads and ~4.7 steps/s with one
[ -n "${PARALLEL:-}${NICE:-}" ] && export OMP_NUM_THREADS=1
mkdir -p "$R"
for s in ${SEEDS:-1 2 3 4 5}; do
  start=$(date +%s)
  echo "seed $s start $(date -u +%FT%TZ)" >> "$R/timing.log"
  [ -f "$R/warmstart/seed$s/eval.json" ] ||
    run train.py --config configs/world_uncertain.yaml --seed=$s --out_dir=$R/warmstart/seed$s
  for arm in rehearse:rehearse frozen:frozen act_only:rehearse real:real; do
    name=${arm%%:*} mode=${arm##*:}
    [ -f "$R/$name/seed$s/eval.json" ] && continue
    coef=1.0; [ "$name" = act_only ] && coef=0.0
    run train.py --config configs/world_uncertain.yaml --seed=$s --out_dir=$R/$name/seed$s \
      --model=$R/warmstart/seed$s/warmstart --sft_steps=0 --rl_steps=200 --env_mode=$mode --rehearse_coef=$coef \
      > $R/$name-seed$s.log 2>&1 &
    [ -n "${PARALLEL:-}" ] || wait     # PARALLEL=1: the four arms at once (one thread each)
  done
  wait
  echo "seed $s end $(date -u +%FT%TZ) seconds $(( $(date +%s) - start ))" >> "$R/timing.log"
  run -m scripts.uncertain_report --lookups $R        # the items the actor looked up, per test task
  run -m scripts.compare --uncertain $R
done
