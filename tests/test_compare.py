"""evaluate.py --compare: the table's arithmetic on made-up metrics, and the files it writes."""
from rehearsal import honesty
from experiments import compare as experiments
import json
from types import SimpleNamespace

import torch
from helpers import toy_tokenizer



def fake_eval(success, errors=0.0, calls=2.0, lookup=1.0, before=None):
    result = {"success": success, "format_errors": errors, "mean_calls": calls,
              "fidelity": {"lookup": lookup, "compute": 1.0, "stateful": 0.5}}
    return {**result, "before": before} if before else result


def test_mean_and_range():
    assert experiments.mean_and_range([0.5, 0.75, 1.0]) == "0.750 (0.500-1.000)"
    assert experiments.mean_and_range([0.25]) == "0.250"
    assert experiments.mean_and_range([None, None]) == "-"


def test_compare_table_arithmetic():
    runs = {"rehearse": [fake_eval(0.9, 0.02, 2.0, 0.95), fake_eval(0.7, 0.0, 3.0, 0.85)],
            "real": [fake_eval(1.0)]}
    lines = experiments.compare_table(runs).splitlines()
    assert lines[0].startswith("| arm | seeds | success |") and len(lines) == 4
    assert lines[2] == ("| rehearse | 2 | 0.800 (0.700-0.900) | 0.900 / 0.700 | 0.010 (0.000-0.020) | "
                        "2.500 (2.000-3.000) | 0.900 (0.850-0.950) | 1.000 (1.000-1.000) | "
                        "0.500 (0.500-0.500) |")
    assert lines[3] == "| real | 1 | 1.000 | 1.000 | 0.000 | 2.000 | 1.000 | 1.000 | 0.500 |"


def test_coverage_table_pools_seeds_before_and_after():
    def cov(rare, common):
        return {"seen 0 times": rare, "seen 50+ times": common}
    runs = {"coverage": [{"before": {"fidelity_by_coverage": cov([1, 4], [9, 10])},
                          "fidelity_by_coverage": cov([0, 2], [10, 10])},
                         {"before": {"fidelity_by_coverage": cov([0, 4], [19, 20])},
                          "fidelity_by_coverage": cov([1, 2], [20, 20])}]}
    lines = experiments.coverage_table(runs).splitlines()
    assert lines[2] == "| coverage | seen 0 times | 0.125 (1/8) | 0.250 (1/4) |"
    assert lines[3] == "| coverage | seen 50+ times | 0.933 (28/30) | 1.000 (30/30) |"
    assert experiments.coverage_table({"real": [fake_eval(1.0)]}) == ""


def test_compare_writes_table_and_figures(tmp_path):
    runs = (("rehearse", "seed1", 0.9), ("rehearse", "seed2", 0.7), ("real", "seed1", 1.0))
    for arm, seed, success in runs:
        folder = tmp_path / arm / seed
        folder.mkdir(parents=True)
        (folder / "eval.json").write_text(json.dumps(fake_eval(success, before={"success": 0.5})))
        (folder / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in (
            {"step": 1}, {"step": 2, "eval_success": 0.6}, {"step": 4})) + "\n")
    sweep = [{"rehearser": "policy", "mode": "parallel", "budget": n, "success": 0.5 + n / 10,
              "imagined_per_task": n, "mean_calls": 2.0} for n in (0, 1, 2, 4)]
    (tmp_path / "rehearse" / "seed1" / "private_rehearsal.json").write_text(json.dumps(sweep))
    (tmp_path / "real" / "seed1" / "coverage.json").write_text(json.dumps(          # evaluate.py --coverage
        {"before": {"seen 0 times": [1, 4]}, "after": {"seen 0 times": [3, 4]}}))
    runs, curves, sweeps = experiments.load_runs(str(tmp_path))
    assert curves["rehearse"][0] == [(0, 0.5), (2, 0.6), (4, 0.9)]         # before, during, after
    assert len(sweeps) == 4 and sweeps[0]["seed"] == "seed1"
    text = experiments.compare(str(tmp_path))
    assert "| policy | parallel | 4 | 0.900 | 4.00 | 2.00 |" in text
    assert "| real | seen 0 times | 0.250 (1/4) | 0.750 (3/4) |" in text
    assert (tmp_path / "results.md").read_text() == text + "\n"
    from matplotlib import colors, image
    for name, size, lines in (("success.png", (540, 840), 2), ("private_rehearsal.png", (480, 720), 1)):
        png = image.imread(tmp_path / name)          # figsize x dpi 120: (7, 4.5) and (6, 4) inches
        assert png.shape == (*size, 4), name
        for c in range(lines):                       # each arm's (each sweep's) line in its cycle colour
            assert (abs(png[..., :3] - colors.to_rgb(f"C{c}")).max(-1) < 0.05).sum() > 20, (name, c)


def test_compare_of_an_empty_folder_is_one_line(tmp_path, capsys):
    assert experiments.main(["--compare", str(tmp_path)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


class Oracle(torch.nn.Module):
    """A fake causal LM whose greedy next token is always the true next token (or, blind, never:
    all-zero logits put the argmax on id 0, the bos tag, which no response contains)."""
    def __init__(self, vocab, blind=False):
        super().__init__()
        self.vocab, self.blind, self.w = vocab, blind, torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, **kwargs):
        logits = torch.zeros(*input_ids.shape, self.vocab)
        if not self.blind:
            logits[:, :-1].scatter_(-1, input_ids[:, 1:, None], 1.0)
        return SimpleNamespace(logits=logits)


def test_coverage_fidelity_scores_the_experts_calls_by_warm_start_count():
    tok = toy_tokenizer()
    tasks = [{"prompt": "cost 2 jam", "calls": ["price jam", "mul 2 , 8"], "answer": "16"},
             {"prompt": "price milk", "calls": ["price milk"], "answer": "2"},
             {"prompt": "price tea", "answer": "4"}]                  # no expert calls: skipped
    counts = {"price milk": 60, "mul 2 , 8": 10}
    seen = honesty.coverage_fidelity(Oracle(len(tok)), tok, tasks, counts)
    assert seen == {"seen 0 times": [1, 1], "seen 1-49 times": [1, 1], "seen 50+ times": [1, 1]}
    blind = honesty.coverage_fidelity(Oracle(len(tok), blind=True), tok, tasks, counts)
    assert blind == {"seen 0 times": [0, 1], "seen 1-49 times": [0, 1], "seen 50+ times": [0, 1]}


def test_paired_table_by_hand():
    """Five seeds' arms (configs/run_all.sh): per arm its success with the bootstrap interval, and the
    paired differences; an arm whose eval.json has no task_rewards (older runs) is left out."""
    def run(seed, rewards):
        return {"seed": seed, "task_rewards": rewards}
    runs = {"rehearse": [run("seed1", [1, 1, 1]), run("seed2", [1, 1, 1])],
            "frozen": [run("seed1", [0, 0, 0]), run("seed2", [0, 0, 0])],
            "real": [run("seed1", [1, 1, 1]), run("seed2", [1, 1, 1])],
            "act_only": [{"seed": "seed1"}]}                             # no per-task outcomes
    lines = experiments.paired_table(runs).splitlines()
    assert lines[2:5] == ["| rehearse | 2 | 1.000 [1.000, 1.000] |", "| frozen | 2 | 0.000 [0.000, 0.000] |",
                          "| real | 2 | 1.000 [1.000, 1.000] |"]
    assert "| rehearse - frozen | +1.000 [+1.000, +1.000] **called** |" in lines     # better on every task
    assert "| real - rehearse | +0.000 [+0.000, +0.000] |" in lines                  # the same outcomes: not called
    assert not any("act_only" in line for line in lines)
    # one seed better by 1 task of 2, the other the same: the mean difference is (0.5 + 0) / 2
    mixed = {"rehearse": [run("seed1", [1, 1]), run("seed2", [0, 1])],
             "frozen": [run("seed1", [1, 0]), run("seed2", [0, 1])]}
    row = [line for line in experiments.paired_table(mixed).splitlines() if line.startswith("| rehearse - frozen")]
    assert row[0].startswith("| rehearse - frozen | +0.250 [+0.000, ") and "called" not in row[0]
    assert experiments.paired_table({"real": [{"seed": "seed1"}]}) == ""


def test_before_after_reads_one_runs_eval_json(tmp_path, capsys):
    """after - before over the same 4 test tasks: (3 - 2) / 4 = +0.250, with the paired
    bootstrap's interval around it; a folder with no eval.json is one line, exit 2. Two runs
    (+0.250 and 0.000 on the same tasks) pooled: +0.125, the mean over runs, with the bootstrap
    over runs then tasks."""
    from experiments import compare as compare_module
    before = {"success": 0.5, "task_rewards": [0.0, 0.0, 1.0, 1.0]}
    (tmp_path / "eval.json").write_text(json.dumps({"success": 0.75, "task_rewards": [1.0, 0.0, 1.0, 1.0],
                                                    "before": before}))
    line = compare_module.before_after([str(tmp_path)])
    diff, low, high, _ = compare_module.paired_bootstrap({1: [1.0, 0.0, 1.0, 1.0]}, {1: [0.0, 0.0, 1.0, 1.0]})
    assert diff == 0.25 and low <= 0.0 < 0.25 <= high <= 1.0
    assert line == (f"{tmp_path}: real-world success 0.500 -> 0.750 on 4 test tasks; after - before +0.250 "
                    f"[{low:+.3f}, {high:+.3f}]")
    other = tmp_path / "seed2"
    other.mkdir()
    (other / "eval.json").write_text(json.dumps({"success": 0.25, "task_rewards": [0.0, 0.0, 0.0, 1.0],
                                                 "before": {"success": 0.25, "task_rewards": [0.0, 0.0, 0.0, 1.0]}}))
    lines = compare_module.before_after([str(tmp_path), str(other)]).splitlines()
    diff, low, high, _ = compare_module.paired_bootstrap({0: [1.0, 0.0, 1.0, 1.0], 1: [0.0, 0.0, 0.0, 1.0]},
                                                         {0: [0.0, 0.0, 1.0, 1.0], 1: [0.0, 0.0, 0.0, 1.0]})
    assert diff == 0.125 and lines[0] == line and lines[1].endswith("+0.000 [+0.000, +0.000]")
    assert lines[2] == (f"2 runs pooled: real-world success 0.375 -> 0.500; after - before +0.125 "
                        f"[{low:+.3f}, {high:+.3f}] (resampling runs, then test tasks)")
    assert compare_module.main(["--before_after", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.startswith(f"error: cannot compare the runs in {tmp_path / 'none'}: ")
