#!/usr/bin/env bash
# Both arms from one warm start, per seed (docs/realmodel.md): SmolLM2-135M in the official layout
# (configs/smollm2-separate.yaml). The warm start and its evaluation run once (--rl_steps=0, into
# $R/warmstart_seed$s); its warmstart/ folder is copied into two run folders, each continued with
# --resume and env_mode rehearse or real (the warm start's evaluation redone there: `before` in each
# eval.json). After each seed: each arm's before/after, and real - rehearse after RL, pooled over
# the seeds done so far (python -m scripts.compare --before_after / --difference).
#   bash configs/run_smollm2_arms.sh [RESULTS]            # seeds 1 2 3 (default RESULTS: out/smollm2-arms)
#   SEEDS=3 bash configs/run_smollm2_arms.sh RESULTS      # one seed
#   ARGS="--device=cuda --rl_steps=60" bash configs/run_smollm2_arms.sh out/smollm2-gpu   # a GPU's budget
# CONFIG names another config (any train.py config runs the same way); ARGS are --key=value
# overrides for every run, the warm start's and both arms'; PARALLEL=1 runs a seed's two arms at
# once, one thread each. Each run's output goes to $R/<run>.log; a run whose eval.json exists is
# kept, not redone (a second call continues with what is left).
set -euo pipefail
cd "$(dirname "$0")/.."
R=${1:-out/smollm2-arms}
CONFIG=${CONFIG:-configs/smollm2-separate.yaml}
read -r -a ARGS <<< "${ARGS:-}"
[ -n "${PARALLEL:-}" ] && export OMP_NUM_THREADS=1
mkdir -p "$R"
pairs=()
for s in ${SEEDS:-1 2 3}; do
  ws=$R/warmstart_seed$s
  [ -f "$ws/warmstart/eval.json" ] ||
    python train.py --config "$CONFIG" --seed="$s" --rl_steps=0 --out_dir="$ws" "${ARGS[@]}" > "$ws.log" 2>&1
  for mode in real rehearse; do
    run=$R/${mode}_seed$s
    [ -f "$run/eval.json" ] && continue
    mkdir -p "$run"
    [ -d "$run/warmstart" ] || cp -r "$ws/warmstart" "$run/"
    python train.py --config "$CONFIG" --seed="$s" --out_dir="$run" --resume --env_mode="$mode" "${ARGS[@]}" \
      > "$run.log" 2>&1 &
    [ -n "${PARALLEL:-}" ] || wait "$!"
  done
  wait
  python -m scripts.compare --before_after "$R/rehearse_seed$s"
  python -m scripts.compare --before_after "$R/real_seed$s"
  pairs+=("$R/real_seed$s" "$R/rehearse_seed$s")
  python -m scripts.compare --difference "${pairs[@]}"
done
