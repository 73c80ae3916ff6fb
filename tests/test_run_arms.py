"""configs/run_smollm2_arms.sh (scripts/arms.py), the driver that runs both arms from one warm start a
seed (and the budget a lent GPU would run), on the toy demo's tiny model: one warm start, two arms
continued from copies of it, each arm's `before` the warm start's own evaluation, the arms' configs
apart in env_mode only, a second call redoing nothing; and the faults a long experiment meets: a
run's error on the terminal, an interrupted warm start or a half-copied arm continued by the next
call, a signal reaching the running train.py, a call with other ARGS refused before it prints the
old runs' figures as its own."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml

from helpers import run_command, without_seconds
from scripts import arms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "configs", "run_smollm2_arms.sh")
TINY = ("--n_test=8 --sft_steps=2 --rl_steps=1 --min_fidelity=0 --tasks_per_step=2 --group_size=2 --n_logged=20 "
        "--n_rl_tasks=20 --snippet_repeats=1")


def arms_env(args=TINY):
    return {**os.environ, "SEEDS": "1", "CONFIG": "small.yaml", "ARGS": args, "OMP_NUM_THREADS": "1",
            "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}


def call(results, timeout=240, args=TINY):
    return run_command(["bash", SCRIPT, str(results)], timeout=timeout, env=arms_env(args))


def one_error_line(done):
    err = done.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), done.stderr[-2000:]
    return err[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One seed's whole design, run once for the module: (results folder, the call's stdout)."""
    results = tmp_path_factory.mktemp("arms") / "results"
    done = call(results)
    assert done.returncode == 0, done.stderr[-2000:]
    return results, done.stdout


def copy_of(finished, tmp_path):
    results = tmp_path / "results"
    shutil.copytree(finished[0], results)
    return results


def eval_json(path):
    with open(path) as f:
        return json.load(f)


def test_both_arms_continue_one_warm_start(finished):
    results, stdout = finished
    warm = without_seconds(eval_json(results / "warmstart_seed1" / "warmstart" / "eval.json"))
    configs = {}
    for mode in ("real", "rehearse"):
        result = eval_json(results / f"{mode}_seed1" / "eval.json")
        assert without_seconds(result["before"]) == warm          # the same warm start, evaluated alike
        with open(results / f"{mode}_seed1" / "config.yaml") as f:
            configs[mode] = yaml.safe_load(f)
        assert configs[mode]["env_mode"] == mode and configs[mode]["rl_steps"] == 1
    assert {k for k in configs["real"] if configs["real"][k] != configs["rehearse"][k]} == {"env_mode", "out_dir"}
    # ARGS's --rl_steps=1 is the arms' budget: the warm start still stops before RL
    with open(results / "warmstart_seed1" / "config.yaml") as f:
        assert yaml.safe_load(f)["rl_steps"] == 0
    assert open(results / "warmstart_seed1" / "metrics.jsonl").read() == ""      # no RL step's line
    lines = stdout.splitlines()
    assert lines[0].startswith(f"{results}/rehearse_seed1: real-world success ")
    assert lines[1].startswith(f"{results}/real_seed1: real-world success ")
    assert lines[2].startswith(f"{results}/real_seed1 - {results}/rehearse_seed1: real-world success ")
    assert len(lines) == 3
    for run in ("warmstart_seed1", "real_seed1", "rehearse_seed1"):      # each log's last line: wall and peak
        last = open(results / f"{run}.log").read().splitlines()[-1]
        words = last.split()
        assert last.startswith(f"{results / run}: exit status 0, ") and words[-6:-2] == ["s", "wall,", "peak", "resident"]
        assert float(words[-7]) > 0 and 100_000 < int(words[-2]) < 24 * 2**20 and words[-1] == "KiB"


def test_a_second_call_redoes_nothing(finished, tmp_path):
    results = copy_of(finished, tmp_path)
    stamps = {p: os.path.getmtime(results / p / "eval.json") for p in ("real_seed1", "rehearse_seed1")}
    again = call(results, timeout=120)
    assert again.returncode == 0 and again.stdout == finished[1].replace(str(finished[0]), str(results))
    assert stamps == {p: os.path.getmtime(results / p / "eval.json") for p in stamps}


def refused(results, args, capsys):
    """scripts.arms in this process (what the wrapper execs): a call refused before anything starts."""
    code = arms.main([str(results), "--seeds", "1", "--config", "small.yaml", f"--args={args}"])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_other_args_than_the_runs_in_results_are_refused_naming_the_key(finished, tmp_path, capsys):
    results = copy_of(finished, tmp_path)
    before = {p: open(results / p / "eval.json").read() for p in ("real_seed1", "rehearse_seed1")}
    line = refused(results, TINY.replace("--rl_steps=1", "--rl_steps=2"), capsys)   # no old figures printed
    assert "rl_steps=1" in line and "rl_steps=2" in line and f"{results}/real_seed1" in line
    assert before == {p: open(results / p / "eval.json").read() for p in before}


@pytest.mark.parametrize("case", ["results a file", "ARGS set the seed", "ARGS not --key=value", "unknown key"])
def test_a_bad_call_is_one_line_before_anything_starts(tmp_path, case, capsys):
    results = tmp_path / "results"
    if case == "results a file":
        results.write_text("mine\n")
    args = {"ARGS set the seed": TINY + " --seed=3", "ARGS not --key=value": TINY + " rl_steps",
            "unknown key": TINY + " --rl_stepz=3"}.get(case, TINY)
    line = refused(results, args, capsys)
    expected = {"results a file": f"RESULTS {results} is a file", "ARGS set the seed": "--seed is set by the driver",
                "ARGS not --key=value": "cannot read 'rl_steps'", "unknown key": "unknown config key 'rl_stepz'"}
    assert expected[case] in line
    if case == "results a file":
        assert results.read_text() == "mine\n"
    else:
        assert not results.exists()


def test_a_runs_error_reaches_the_terminal_naming_its_log(tmp_path):
    done = call(tmp_path / "results", timeout=120, args=TINY + " --logged_file=" + str(tmp_path / "missing.jsonl"))
    line = one_error_line(done)
    log = tmp_path / "results" / "warmstart_seed1.log"
    assert done.returncode == 2 and f"warmstart_seed1: exit status 2: " in line and f"(its log: {log})" in line
    assert "missing.jsonl" in line                              # train.py's own line, carried over


def test_an_interrupted_warm_start_evaluation_is_continued_by_the_next_call(finished, tmp_path):
    results = copy_of(finished, tmp_path)
    warm = results / "warmstart_seed1"
    # as a stop in the warm start's evaluation leaves it: warmstart/ saved, no evaluation, no RL checkpoint
    for name in ("warmstart/eval.json", "eval.json"):
        os.remove(warm / name)
    shutil.rmtree(warm / "ckpt")
    done = call(results, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert without_seconds(eval_json(warm / "warmstart" / "eval.json")) == \
        without_seconds(eval_json(results / "real_seed1" / "eval.json")["before"])


def test_a_half_copied_arm_is_copied_again(finished, tmp_path):
    results = copy_of(finished, tmp_path)
    arm = results / "real_seed1"
    shutil.rmtree(arm)
    shutil.copytree(results / "warmstart_seed1" / "warmstart", arm / "warmstart")
    weights = arm / "warmstart" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])             # a copy cut short
    done = call(results, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    # the arm ran again from a whole copy: the same run, the same figures (one process, the same kernels)
    assert without_seconds(eval_json(arm / "eval.json")) == \
        without_seconds(eval_json(finished[0] / "real_seed1" / "eval.json"))
    assert not os.path.exists(arm / "warmstart.copying")


def processes_naming(text):
    """The pids of running processes whose command line holds `text`."""
    pids = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    pids.append(int(pid))
        except (OSError, ValueError):
            pass
    return pids


def test_sigterm_to_the_driver_reaches_its_train_py_and_exits_130(tmp_path):
    results = tmp_path / "results"
    proc = subprocess.Popen(["bash", SCRIPT, str(results)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=arms_env(TINY.replace("--sft_steps=2", "--sft_steps=100000")))
    try:
        log = results / "warmstart_seed1.log"
        deadline = time.time() + 60
        while time.time() < deadline and "warm start:" not in (log.read_text() if log.exists() else ""):
            time.sleep(0.2)
        assert processes_naming(str(results)), "train.py did not start"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("interrupted: ") and "the same command continues" in lines[0]
    assert processes_naming(str(results)) == []                  # no train.py left running
    assert "interrupted" in log.read_text()                      # train.py got the signal and said so
