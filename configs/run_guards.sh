#!/usr/bin/env bash
# The guard comparison: which guard keeps the rehearsed world honest (fidelity per tool kind,
# collusion rate) at the least cost in real-world success? Every arm over 3 seeds, 200 RL steps.
#   bash configs/run_guards.sh [RESULTS]           # default RESULTS: out/guards
#   SEEDS="1" bash configs/run_guards.sh out/g1    # one seed, another folder
# Run configs/run_all.sh first: the inline arms start from its warm start of each seed (WS, default
# out/toy/warmstart) and its `real` arm is copied (the real world has nothing to collude with).
# The separate-layout arms need their own warm starts (their rehearse prompts differ). JOBS runs
# at the same time (default 2, one per core; OMP_NUM_THREADS=1 each).
set -euo pipefail
cd "$(dirname "$0")/.."
R=${1:-out/guards}
WS=${WS:-out/toy/warmstart}
SEEDS=${SEEDS:-1 2 3}
export OMP_NUM_THREADS=1
run() {   # run CONFIG SEED [WARM_START]: one arm, a failure (e.g. the fidelity gate) reported, not fatal
  local extra=()
  [ -n "${3:-}" ] && extra=(--model="$3" --sft_steps=0)
  python train.py --config "configs/$1.yaml" --seed="$2" --out_dir="$R/$1/seed$2" "${extra[@]}" \
    > "$R/logs/$1-seed$2.txt" 2>&1 || echo "FAILED (exit $?): $1 seed $2, see $R/logs/$1-seed$2.txt"
  grep -a "real-world success .* ->" "$R/logs/$1-seed$2.txt" | sed "s/^/$1 seed $2: /" || true
}
export -f run
export R
mkdir -p "$R/logs"
for s in $SEEDS; do
  [ -f "$WS/seed$s/warmstart/config.json" ] || { echo "error: no warm start in $WS/seed$s/warmstart: run configs/run_all.sh first" >&2; exit 2; }
done
{ for s in $SEEDS; do echo "warmstart_separate $s"; echo "warmstart_ground $s"; done
  for s in $SEEDS; do for arm in rehearse guard_kl guard_check act_only; do
    echo "$arm $s $WS/seed$s/warmstart"; done; done
} | xargs -P "${JOBS:-2}" -L 1 bash -c 'run "$@"' _
{ for s in $SEEDS; do
    for arm in separate guard_rolewise; do echo "$arm $s $R/warmstart_separate/seed$s/warmstart"; done
    for arm in guard_ground guard_all; do echo "$arm $s $R/warmstart_ground/seed$s/warmstart"; done
  done
} | xargs -P "${JOBS:-2}" -L 1 bash -c 'run "$@"' _
for s in $SEEDS; do     # the real-world arm of run_all.sh, for reference
  mkdir -p "$R/real/seed$s" && cp "$(dirname "$WS")/real/seed$s/"{eval.json,metrics.jsonl} "$R/real/seed$s/" || true
done
python -m scripts.compare --compare "$R"
