#!/usr/bin/env bash
# The experiment behind the README's Results: every arm over 3 seeds, the private-rehearsal
# sweep, then the comparison table and figures.
#   bash configs/run_all.sh                 # writes results/ (about 45 min on 2 CPU cores)
#   SEEDS="1" bash configs/run_all.sh out   # one seed, another folder
# Each seed's warm start is trained once (configs/warmstart.yaml) and every RL arm starts from it;
# the coverage arm trains its own, on the data it is allowed to see.
set -euo pipefail
cd "$(dirname "$0")/.."
R=${1:-results}
for s in ${SEEDS:-1 2 3}; do
  python train.py --config configs/warmstart.yaml --seed=$s --out_dir=$R/warmstart/seed$s
  for arm in rehearse real frozen act_only no_env; do
    python train.py --config configs/$arm.yaml --seed=$s --out_dir=$R/$arm/seed$s \
      --model=$R/warmstart/seed$s/warmstart --sft_steps=0
  done
  python train.py --config configs/coverage.yaml --seed=$s --out_dir=$R/coverage/seed$s
  # test-time private rehearsal with the paper's eval sampling (T 0.6, top-p 0.95): the EnvACE
  # model imagines with its own world model, or with the warm start's
  python evaluate.py --ckpt $R/rehearse/seed$s --sweep --rehearser $R/warmstart/seed$s/warmstart \
    --eval_temperature=0.6 --top_p=0.95 --imagine_temperature=0.6
done
python experiments.py --compare $R
