#!/usr/bin/env bash
# Both arms from one warm start, per seed (docs/realmodel.md): SmolLM2-135M in the official layout
# (configs/smollm2-separate.yaml). A thin wrapper over `python -m scripts.arms` (its docstring says what
# runs, how a second call continues what is left, and what it refuses):
#   bash configs/run_smollm2_arms.sh [RESULTS]            # seeds 1 2 3 (default RESULTS: out/smollm2-arms)
#   SEEDS=3 bash configs/run_smollm2_arms.sh RESULTS      # one seed
#   ARGS="--device=cuda --rl_steps=60" bash configs/run_smollm2_arms.sh out/smollm2-gpu   # a GPU's budget
# CONFIG names another config (any train.py config runs the same way); ARGS are --key=value
# overrides for every run (the warm start stops at --rl_steps=0 whatever ARGS say); PARALLEL=1 runs a
# seed's two arms at once, one thread each. Each run's output goes to RESULTS/<run>.log.
set -euo pipefail
cd "$(dirname "$0")/.."
read -r -a seeds <<< "${SEEDS:-1 2 3}"
exec python -m scripts.arms "${1:-out/smollm2-arms}" --seeds "${seeds[@]}" \
  --config "${CONFIG:-configs/smollm2-separate.yaml}" --args="${ARGS:-}" ${PARALLEL:+--parallel}
