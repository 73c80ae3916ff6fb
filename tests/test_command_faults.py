"""The experiments' command lines (scripts/compare.py, choice_sweep.py, uncertain_report.py): a
bad option or path is one `error:` line naming it, exit 2, before any model is loaded or any file
written. (machinery.realmodel, benchmarks.tau2bench and scripts/speed.py: their own test files.)"""
import json
import os

import pytest

from scripts import choice_sweep, compare, uncertain_report


def the_line(capsys):
    """The one line on stderr of a command that refused its options (and nothing on stdout)."""
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in captured.err and captured.out == "", captured
    return lines[0]


@pytest.fixture
def nothing_loaded(monkeypatch):
    """Every way the commands load a model or run their measure refuses: an option refused by main
    never reaches one."""
    def loaded(*args, **kwargs):
        raise AssertionError("work started before the options were checked")
    monkeypatch.setattr(choice_sweep, "load_run", loaded)
    monkeypatch.setattr(choice_sweep, "report", loaded)
    monkeypatch.setattr(uncertain_report, "write_lookups", loaded)
    monkeypatch.setattr(compare, "compare", loaded)
    monkeypatch.setattr(compare, "uncertain", loaded)
    monkeypatch.setattr(compare, "before_after", loaded)
    monkeypatch.setattr(compare, "difference", loaded)


def test_compare_refuses_missing_folders_and_runs_without_eval_json(tmp_path, capsys, nothing_loaded):
    """Before: no option (or two) was argparse's usage block; a missing folder a line only after
    the loading had started."""
    (tmp_path / "run").mkdir()
    cases = [
        ([], "one of the arguments --compare --uncertain --before_after --difference --validation --curves is required (--help lists the options)"),
        (["--compare", "a", "--uncertain", "b"], "argument --uncertain: not allowed with argument --compare "
                                                 "(--help lists the options)"),
        (["--compare", str(tmp_path / "nope")], f"--compare {tmp_path / 'nope'}: no such folder (a results folder "
                                                "holds <arm>/<seed>/ runs)"),
        (["--uncertain", str(tmp_path / "nope")], f"--uncertain {tmp_path / 'nope'}: no such folder (a results "
                                                  "folder holds <arm>/<seed>/ runs)"),
        (["--before_after", str(tmp_path / "run")], f"--before_after {tmp_path / 'run'}: no eval.json in it (a "
                                                    "finished run of train.py has one)"),
        (["--before_after", str(tmp_path / "run"), str(tmp_path / "gone")],
         f"--before_after {tmp_path / 'run'}: no eval.json in it (a finished run of train.py has one)"),
        (["--difference", str(tmp_path / "gone"), str(tmp_path / "run")], f"--difference {tmp_path / 'gone'}: no such folder"),
    ]
    for argv, line in cases:
        assert compare.main(argv) == 2, argv
        assert the_line(capsys) == f"error: {line}"
    (tmp_path / "run" / "eval.json").write_text("{}")
    assert compare.main(["--before_after", str(tmp_path / "run"), str(tmp_path / "gone")]) == 2
    assert the_line(capsys) == f"error: --before_after {tmp_path / 'gone'}: no such folder"
    assert sorted(os.listdir(tmp_path)) == ["run"] and os.listdir(tmp_path / "run") == ["eval.json"]


def test_choice_sweep_checks_its_options_before_loading_the_model(tmp_path, capsys, nothing_loaded):
    """Before: --report on a missing folder was a traceback and on a folder without sweeps an empty
    report (exit 0); --n_test 0, a missing --rehearser or --out a folder were found only after the
    model was loaded (--out: after the whole sweep, a traceback, the rows lost)."""
    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "results").mkdir()
    cases = [
        ([], "give --ckpt RUN (a run folder of train.py) or --report RESULTS"),
        (["--report", str(tmp_path / "nope")], f"--report {tmp_path / 'nope'}: no such folder"),
        (["--report", str(tmp_path / "results")], f"--report {tmp_path / 'results'}: no sweep_MODEL-seedN.json in "
                                                  "it (configs/run_choice.sh writes them)"),
        (["--report", str(tmp_path / "results"), "--ckpt", str(run), "--n_test", "5"],
         "--report reads the results of configs/run_choice.sh; it takes no --ckpt, --n_test"),
        (["--report", str(tmp_path / "results"), "--seed=3"], "--report reads the results of configs/run_choice.sh; "
                                                               "it takes no --seed=3"),
        (["--ckpt", str(tmp_path / "nope")], f"--ckpt {tmp_path / 'nope'}: no such folder"),
        (["--ckpt", str(run), "--n_test", "0"], "--n_test must be at least 1, got 0"),
        (["--ckpt", str(run), "--n_test", "some"], "argument --n_test: invalid int value: 'some' (--help lists the "
                                                   "options)"),
        (["--ckpt", str(run), "--rehearser", str(tmp_path / "nope")],
         f"--rehearser {tmp_path / 'nope'}: no checkpoint written by train.py in it"),
        (["--ckpt", str(run), "--diagnose", "--rehearser", str(run)],
         "--diagnose imagines with the model itself: it takes no --rehearser"),
        (["--ckpt", str(run), "--out", str(tmp_path)], f"--out '{tmp_path}' is a folder: give a JSON file"),
        (["--ckpt", str(run), "--out", str(tmp_path / "no" / "rows.json")],
         f"--out {tmp_path / 'no' / 'rows.json'}: no folder {tmp_path / 'no'}"),
    ]
    for argv, line in cases:
        assert choice_sweep.main(argv) == 2, argv
        assert the_line(capsys) == f"error: {line}"
    assert sorted(os.listdir(tmp_path)) == ["results", "run"]
    assert os.listdir(run) == os.listdir(tmp_path / "results") == []


def test_choice_sweep_report_takes_a_folder_of_sweeps(tmp_path, capsys, monkeypatch):
    """The check lets a folder of sweeps through to the report (the report itself:
    tests/test_world_choice.py)."""
    (tmp_path / "sweep_rl-seed1.json").write_text("[]")
    monkeypatch.setattr(choice_sweep, "report", lambda folder: f"the report of {folder}\n")
    assert choice_sweep.main(["--report", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"the report of {tmp_path}\n"


def test_uncertain_report_checks_its_options_before_loading_a_model(tmp_path, capsys, nothing_loaded):
    """Before: --lookups on a missing folder or one without finished runs printed nothing and
    exited 0; no option or a bad --split was argparse's usage block; --n 0 a report of no task."""
    (tmp_path / "results" / "rehearse" / "1").mkdir(parents=True)
    cases = [
        ([], "one of the arguments --failures --lookups is required (--help lists the options)"),
        (["--failures", "a", "--lookups", "b"], "argument --lookups: not allowed with argument --failures "
                                                "(--help lists the options)"),
        (["--lookups", str(tmp_path / "nope")], f"--lookups {tmp_path / 'nope'}: no such folder"),
        (["--lookups", str(tmp_path / "results")], f"--lookups {tmp_path / 'results'}: no finished run in it "
                                                   "(<arm>/<seed>/eval.json)"),
        (["--lookups", str(tmp_path / "results"), "--n", "3"], "--lookups runs every finished run's test tasks; it "
                                                               "takes no --n"),
        (["--failures", str(tmp_path / "nope")], f"no checkpoint written by train.py in {tmp_path / 'nope'}"),
        (["--failures", str(tmp_path), "--n", "0"], "--n must be at least 1, got 0"),
        (["--failures", str(tmp_path), "--split", "train"], "argument --split: invalid choice: 'train' (choose from "
                                                            "'test', 'rl') (--help lists the options)"),
    ]
    for argv, line in cases:
        assert uncertain_report.main(argv) == 2, argv
        assert the_line(capsys) == f"error: {line}"
    (tmp_path / "results" / "rehearse" / "1" / "eval.json").write_text(json.dumps({"success": 0.5}))
    with pytest.raises(AssertionError, match="work started"):             # a finished run: the lookups start
        uncertain_report.main(["--lookups", str(tmp_path / "results")])
