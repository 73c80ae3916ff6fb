#!/usr/bin/env bash
# Private rehearsal where imagination carries information (the paper's claim 4;
# docs/imagination.md): per seed, the warm start and RL with rehearsal memories of
# configs/choice3.yaml (three options), then success at N = 0, 1, 2, 4 imagined episodes (parallel and sequential)
# on the warm start (as its own rehearser) and on the RL model (itself, and the warm start playing
# the world), with the paired bootstrap against N = 0.
#   bash configs/run_choice.sh [RESULTS]       # seeds 1 2 3 4 5 (default RESULTS: out/choice)
#   SEEDS=1 bash configs/run_choice.sh         # the reduced variant
#   bash configs/run_choice.sh results/choice-3-options_memory-sweep_seeds1-5
#   CONFIG=configs/choice.yaml SEEDS=1 bash configs/run_choice.sh results/choice-2-options_memory-sweep_seed1
#                                              # made the two experiments in results/ (a run retrains:
#                                              # --overwrite); python -m scripts.choice_sweep --report FOLDER remakes the tables
# Three options are the experiment: with two, N = 0 already bought right in 0.970 of the test
# tasks (results/choice-2-options_memory-sweep_seed1/), too close to the ceiling for a memory to show a gain.
# NICE=15 runs every step under `nice -n 15` with OMP_NUM_THREADS=1 (a shared machine). Run
# folders (weights) go to $R/seedS/, the logs to $R/*.log (both git-ignored under results/); the
# figures' inputs to $R/*.json and $R/metrics-seedS.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
R=${1:-out/choice}
CONFIG=${CONFIG:-configs/choice3.yaml}
run() { nice -n "${NICE:-0}" python "$@"; }
[ -n "${NICE:-}" ] && export OMP_NUM_THREADS=1
mkdir -p "$R"
for s in ${SEEDS:-1 2 3 4 5}; do
  run train.py --config $CONFIG --seed=$s --out_dir=$R/seed$s --overwrite 2>&1 \
    | grep --line-buffered -v "it/s" | tee $R/train-seed$s.log
  cp $R/seed$s/warmstart/eval.json $R/eval_warmstart-seed$s.json
  cp $R/seed$s/eval.json $R/eval_rl-seed$s.json
  cp $R/seed$s/metrics.jsonl $R/metrics-seed$s.jsonl
  run -m scripts.choice_sweep --ckpt $R/seed$s/warmstart --out $R/sweep_warmstart-seed$s.json | tee $R/sweep_warmstart-seed$s.log
  run -m scripts.choice_sweep --ckpt $R/seed$s --out $R/sweep_rl-seed$s.json | tee $R/sweep_rl-seed$s.log
  run -m scripts.choice_sweep --report $R > /dev/null           # the tables and figure of the seeds so far
done
