#!/usr/bin/env bash
# The guard comparison (issue 7): does a guard keep the rehearsed world honest (fidelity per tool
# kind, collusion rate) without losing the real-world gain? Run after configs/run_all.sh: every
# guard arm starts from run_all.sh's warm start of its seed and writes beside its arms, which are
# reused, not rerun: rehearse (no guard), act_only, real.
#   bash configs/run_guards.sh                 # into results/ (6 RL runs of 200 steps)
#   SEEDS="1" bash configs/run_guards.sh out   # one seed, another folder (warm starts in out/)
set -euo pipefail
cd "$(dirname "$0")/.."
R=${1:-results}
for s in ${SEEDS:-1 2 3}; do
  ws=$R/warmstart/seed$s/warmstart
  if [ ! -f "$ws/config.json" ]; then
    echo "error: no warm start in $ws: run configs/run_all.sh (its warmstart line) first" >&2
    exit 2
  fi
  for arm in guard_kl guard_check; do
    python train.py --config configs/$arm.yaml --seed=$s --out_dir=$R/$arm/seed$s --model=$ws --sft_steps=0
  done
  # ---- arms that need the other branch's keys (rehearsal_context: separate, grounding_examples,
  # advantage_groups: task_role); uncomment once configs/guard_{ground,rolewise,all}.yaml exist:
  # for arm in guard_ground guard_rolewise guard_all; do
  #   python train.py --config configs/$arm.yaml --seed=$s --out_dir=$R/$arm/seed$s --model=$ws --sft_steps=0
  # done
  # ---- the reused arms: if they were trained before collusion was measured, measure it now at
  # evaluation (collusion.json beside eval.json, which is left as it is); their per-step RL
  # collusion cannot be recovered (rerun them with run_all.sh's lines for that)
  for arm in rehearse act_only real; do
    if [ -f "$R/$arm/seed$s/eval.json" ] && ! grep -q '"collusion"' "$R/$arm/seed$s/eval.json"; then
      python evaluate.py --ckpt "$R/$arm/seed$s" --collusion
    fi
  done
done
python evaluate.py --compare "$R"
