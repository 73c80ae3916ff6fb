"""configs/run_smollm2_arms.sh, the script that runs both arms from one warm start a seed (and
the budget a lent GPU would run), on the toy demo's tiny model: one warm start, two arms
continued from copies of it, each arm's `before` the warm start's own evaluation, the arms'
configs apart in env_mode only, and a second call redoing nothing."""
import json
import os
import sys

import yaml

from helpers import run_command, without_seconds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ("--n_test=8 --sft_steps=2 --rl_steps=1 --min_fidelity=0 --tasks_per_step=2 --group_size=2 --n_logged=20 "
        "--n_rl_tasks=20 --snippet_repeats=1")


def test_both_arms_continue_one_warm_start(tmp_path):
    env = {**os.environ, "SEEDS": "1", "CONFIG": "small.yaml", "ARGS": TINY, "OMP_NUM_THREADS": "1",
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    script = os.path.join(ROOT, "configs", "run_smollm2_arms.sh")
    done = run_command(["bash", script, str(tmp_path)], timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(tmp_path / "warmstart_seed1" / "warmstart" / "eval.json") as f:
        warm = without_seconds(json.load(f))
    configs = {}
    for mode in ("real", "rehearse"):
        with open(tmp_path / f"{mode}_seed1" / "eval.json") as f:
            result = json.load(f)
        assert without_seconds(result["before"]) == warm          # the same warm start, evaluated alike
        with open(tmp_path / f"{mode}_seed1" / "config.yaml") as f:
            configs[mode] = yaml.safe_load(f)
        assert configs[mode]["env_mode"] == mode and configs[mode]["rl_steps"] == 1
    assert {k for k in configs["real"] if configs["real"][k] != configs["rehearse"][k]} == {"env_mode", "out_dir"}
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"{tmp_path}/rehearse_seed1: real-world success ")
    assert lines[1].startswith(f"{tmp_path}/real_seed1: real-world success ")
    assert lines[2].startswith(f"{tmp_path}/real_seed1 - {tmp_path}/rehearse_seed1: real-world success ")
    assert len(lines) == 3
    stamps = {p: os.path.getmtime(tmp_path / p / "eval.json") for p in ("real_seed1", "rehearse_seed1")}
    again = run_command(["bash", script, str(tmp_path)], timeout=120, env=env)
    assert again.returncode == 0 and again.stdout == done.stdout      # kept, not redone: the same lines
    assert stamps == {p: os.path.getmtime(tmp_path / p / "eval.json") for p in stamps}
