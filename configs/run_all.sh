#!/usr/bin/env bash
# The toy world's arms over the seeds, the private-rehearsal sweep, then the comparison table and
# figures (python -m scripts.compare --compare).
#   bash configs/run_all.sh [RESULTS]       # all six arms, seeds 1-3, the sweep (default RESULTS: out/toy)
#   SEEDS="1" bash configs/run_all.sh       # one seed (about 15 min on 2 quiet CPU cores)
#   SEEDS="1 2 3 4 5" ARMS="rehearse real frozen act_only" SWEEP=0 PARALLEL=1 bash configs/run_all.sh results/toy_rehearse-real-frozen-act_only_seeds1-5
#                                           # made the experiment in results/ (92 min on 2 CPU cores);
#                                           # python -m scripts.compare --compare FOLDER remakes its tables
# Each seed's warm start is trained once (configs/warmstart.yaml) and every RL arm starts from it;
# the coverage arm trains its own, on the data it is allowed to see. ARMS picks the arms (default
# all six), SWEEP=0 skips the sweep; PARALLEL=1 runs a seed's arms at once and NICE=15 runs every
# step under `nice -n 15`, either with OMP_NUM_THREADS=1 (a shared machine); each arm's output goes
# to $R/ARM-seedS.log (and to the terminal unless PARALLEL). A run whose eval.json exists is kept,
# not redone (a second call continues with what is left).
set -euo pipefail
cd "$(dirname "$0")/.."
R=${1:-out/toy}
run() { nice -n "${NICE:-0}" python "$@"; }
[ -n "${PARALLEL:-}${NICE:-}" ] && export OMP_NUM_THREADS=1
mkdir -p "$R"
for s in ${SEEDS:-1 2 3}; do
  start=$(date +%s)
  [ -f "$R/warmstart/seed$s/eval.json" ] ||
    run train.py --config configs/warmstart.yaml --seed=$s --out_dir=$R/warmstart/seed$s
  for arm in ${ARMS:-rehearse real frozen act_only no_env coverage}; do
    [ -f "$R/$arm/seed$s/eval.json" ] && continue
    args=(--config configs/$arm.yaml --seed=$s --out_dir=$R/$arm/seed$s)
    [ "$arm" = coverage ] || args+=(--model=$R/warmstart/seed$s/warmstart --sft_steps=0)
    if [ -n "${PARALLEL:-}" ]; then
      run train.py "${args[@]}" > $R/$arm-seed$s.log 2>&1 &
    else
      run train.py "${args[@]}" 2>&1 | tee $R/$arm-seed$s.log
    fi
  done
  wait
  echo "seed $s seconds $(( $(date +%s) - start ))" >> "$R/timing.log"
  # test-time private rehearsal with the paper's eval sampling (T 0.6, top-p 0.95): the EnvACE
  # model imagines with its own world model, or with the warm start's
  [ "${SWEEP:-1}" = 0 ] || run evaluate.py --ckpt $R/rehearse/seed$s --sweep --rehearser $R/warmstart/seed$s/warmstart \
    --eval_temperature=0.6 --top_p=0.95 --imagine_temperature=0.6
  run -m scripts.compare --compare $R > /dev/null
done
run -m scripts.compare --compare $R
