"""The curve of a run (reporting/metrics.py: curve_points, draw_curves): what train.py writes as
curve.png at the end of a run, and `python -m scripts.compare --curves RUN [RUN ...]` for several."""
import json
import os

from reporting.metrics import curve_points, draw_curves
from scripts import compare

PNG = b"\x89PNG\r\n\x1a\n"


def fake_run(folder, lines, result):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    if result is not None:
        with open(os.path.join(folder, "eval.json"), "w") as f:
            json.dump(result, f)
    return str(folder)


def test_curve_points_read_the_evaluations_and_every_steps_reward(tmp_path):
    """Three steps, evaluated at step 2 (eval_every 2): success at 0 (the warm start, eval.json's
    before), 2 (the step's line) and 3 (the final eval.json, at the last step); a skipped step has no
    clip_frac (None)."""
    run = fake_run(tmp_path / "a", [{"step": 1, "reward": 0.25, "clip_frac": 0.0},
                                    {"step": 2, "reward": 0.5, "clip_frac": 0.125, "eval_success": 0.6},
                                    {"step": 3, "reward": 0.75, "status": "skipped"}],
                   {"success": 0.7, "before": {"success": 0.4}})
    assert curve_points(run) == {"steps": [1, 2, 3], "reward": [0.25, 0.5, 0.75], "clip_frac": [0.0, 0.125, None],
                                 "success": [(0, 0.4), (2, 0.6), (3, 0.7)], "validation": []}
    # with a validation split the evaluations during RL are on it: their own series, from the warm start's
    val = fake_run(tmp_path / "v", [{"step": 1, "reward": 0.5, "val_success": 0.25}],
                   {"success": 0.5, "before": {"success": 0.3, "val_success": 0.2}})
    assert curve_points(val)["success"] == [(0, 0.3), (1, 0.5)]
    assert curve_points(val)["validation"] == [(0, 0.2), (1, 0.25)]
    # a run still going (no eval.json yet): its steps, no success point
    going = fake_run(tmp_path / "g", [{"step": 1, "reward": 0.5}], None)
    assert curve_points(going)["success"] == [] and curve_points(going)["reward"] == [0.5]


def test_draw_curves_writes_a_png_and_compare_draws_several(tmp_path, capsys):
    a = fake_run(tmp_path / "a", [{"step": 1, "reward": 0.25, "clip_frac": 0.0}], {"success": 0.7, "before": {"success": 0.4}})
    b = fake_run(tmp_path / "b", [{"step": 1, "reward": 0.5, "clip_frac": 0.1}], {"success": 0.6, "before": {"success": 0.4}})
    path = tmp_path / "one.png"
    draw_curves([a], str(path), ["rehearse"])
    assert path.read_bytes()[:8] == PNG
    out = tmp_path / "two.png"
    assert compare.main(["--curves", a, b, "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG and "2 run(s)" in capsys.readouterr().out
    # a folder without metrics.jsonl, a missing folder: one line each, exit 2, nothing written
    for bad, why in ((str(tmp_path), "no metrics.jsonl"), (str(tmp_path / "nope"), "no such folder")):
        assert compare.main(["--curves", bad, "--out", str(tmp_path / "bad.png")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0]
    assert not (tmp_path / "bad.png").exists()
