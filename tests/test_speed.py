"""scripts/speed.py runs end to end on tiny batches of both workloads and writes its JSON (speed itself is
never asserted), the generate-driven baseline builds well-formed interleaved episodes with our
state machine, and the GPU script's Qwen3 path runs on the CPU at a tiny shape."""
import ast
import json
import os
import resource

import pytest

from scripts import speed
import envace
import world
from envace import encode
from helpers import tiny_llama, toy_tokenizer
from test_faults import sigterm_guard  # noqa: F401  (a fixture)

TOK = toy_tokenizer()
FIGURES = ("sampler_rehearse", "sampler_real", "sampler_separate", "generate_rehearse", "generate_real",
           "generate_one_call", "old_logprob_forward", "train_step")


def test_speed_imports_no_test_helper_and_no_private_name():
    """scripts/speed.py is a command users type, so it stands on the library alone: nothing imported from
    tests/ (what it shares with the tests lives in the library: chat.toytokenizer), and no
    module's private name (_x), imported or read as module._x. Mutations: `from tests.helpers
    import chat_tokenizer`, `from rollout import _append`, `import rollout` and
    `rollout._append_run` called."""
    tree = ast.parse(open(speed.__file__).read())
    froms = [(n.module, a) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
    modules = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {a.asname or a.name for m, a in froms if m.split(".")[0] in ("chat", "machinery", "worldmodel")}
    assert {"world", "chat", "chat_tasks", "json"} <= modules      # (the check sees the module's imports)
    assert [m for m, _ in froms if m.split(".")[0] in ("tests", "helpers")] == []
    assert [f"{m}.{a.name}" for m, a in froms if a.name.startswith("_")] == []
    assert [f"{n.value.id}.{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and n.attr.startswith("_") and isinstance(n.value, ast.Name) and n.value.id in modules] == []


def test_timed_in_turn_alternates_the_calls_after_one_warm_up_each():
    calls = []
    times = speed.timed_in_turn([lambda: calls.append("a"), lambda: calls.append("b")], "cpu", 3)
    assert calls == ["a", "b"] + ["a", "b"] * 3
    assert len(times) == 2 and all(len(t) == 3 and min(t) >= 0 for t in times)
    assert speed.ratio_in_turn([1.0, 2.0, 10.0], [3.0, 8.0, 9.0]) == pytest.approx(3.0)   # not 8 / 2


def test_speed_writes_every_figure_of_both_workloads(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert speed.main(["--tasks", "2", "--group_size", "2", "--repeats", "2", "--min_seconds", "0",
                       "--out", str(out), "--ckpt", "", "--pad_tools", "1", "--max_new", "120"]) == 0
    result = json.loads(out.read_text())
    assert result["repeats"] == 2
    for name in ("toy", "chat"):
        r = result[name]
        assert r["rows"] == 4
        for key in FIGURES:
            figure = r[key]
            assert figure["tok_per_s"] == pytest.approx(figure["tokens"] / figure["seconds"], rel=1e-9), key
            assert figure["min_s"] <= figure["seconds"] <= figure["max_s"], key
            assert figure["tokens"] >= r["rows"], key          # every row writes at least its hand-off
        assert r["ratio_rehearse"] == pytest.approx(r["sampler_rehearse"]["tok_per_s"] / r["generate_rehearse"]["tok_per_s"])
        assert r["separate_vs_inline_time"] == pytest.approx(r["sampler_separate"]["seconds"] / r["sampler_rehearse"]["seconds"])
        # one generate call decodes the longest rehearse-mode row's length for each of the 4 rows
        assert r["generate_one_call"]["tokens"] % 4 == 0
        assert r["generate_one_call"]["tokens"] >= r["sampler_rehearse"]["tokens"]
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        assert r["parameters"] * 4 / 2 ** 20 <= r["peak_memory_mb"] <= peak
        assert r["train_step"]["estimate_train_gib"] > 0 and "mfu" not in r["train_step"]   # no peak given on CPU
        # the median of the two pairs' ratios, i.e. their mean: between the extremes' ratios
        shared, plain = r["update_shared"], r["update_plain"]
        assert plain["min_s"] / shared["max_s"] <= r["shared_vs_plain"] <= plain["max_s"] / shared["min_s"]
    assert [line.split(": ")[0] for line in capsys.readouterr().out.splitlines()
            if line.startswith("update shared")] == ["update shared prefix / plain"] * 2
    # the toy update's batch is the last real-mode sample: its ids are the sampled ones plus the prompts
    tasks = world.make_splits(0, 10, 0, 200, 10)["rl"][:2]
    prompt_ids = 2 * sum(1 + len(encode(TOK, t["prompt"])) for t in tasks)
    toy = result["toy"]
    assert toy["old_logprob_forward"]["tokens"] == toy["train_step"]["tokens"] == toy["sampler_real"]["tokens"] + prompt_ids
    # chat, forced gold calls: every real-mode row called the toy world; rehearse rows rehearsed
    assert sum(toy["sampler_real"]["causes"].values()) == 4
    assert result["chat"]["sampler_real"]["tokens"] > result["chat"]["sampler_rehearse"]["tokens"] / 2



def test_speed_json_goes_under_out_by_default(tmp_path, monkeypatch):
    """Without --out the JSON goes to out/bench.json (a git-ignored folder, made if missing), so a
    run from the repository root leaves nothing untracked beside the code."""
    monkeypatch.chdir(tmp_path)
    assert speed.main(["--workload", "toy", "--tasks", "1", "--group_size", "2", "--repeats", "1",
                       "--min_seconds", "0", "--ckpt", ""]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["toy"]["rows"] == 2

def test_the_gpu_scripts_qwen3_path_runs_on_cpu_at_a_tiny_shape(tmp_path):
    out = tmp_path / "bench.json"
    assert speed.main(["--workload", "chat", "--size", "qwen3-tiny", "--tasks", "1", "--group_size", "2",
                       "--repeats", "1", "--min_seconds", "0", "--pad_tools", "0", "--max_new", "80", "--peak_tflops", "1",
                       "--out", str(out)]) == 0
    chat = json.loads(out.read_text())["chat"]
    assert chat["model"].startswith("random Qwen3 (tiny shape") and chat["rows"] == 2
    step = chat["train_step"]
    n_params = chat["parameters"]
    assert step["mfu"] == pytest.approx(6 * n_params * step["tokens"] / step["seconds"] / 1e12)


def test_generate_baseline_builds_interleaved_episodes():
    tok = toy_tokenizer()
    rows = speed.generate_episodes(tiny_llama(tok), tok, ["price apple", "buy tea"], "real",
                                   speed.DEFAULTS, seed=0, plans=[[("price apple", "3")], []])
    for r, prompt in zip(rows, ["price apple", "buy tea"]):
        words = tok.convert_ids_to_tokens(r["ids"])
        assert " ".join(words[:r["prompt_len"] + 1]) == f"<bos> {prompt} <act>"
        assert len(words) > r["prompt_len"] + 1 and r["cause"]          # the actor wrote something, it ended
        for t, w in enumerate(words):                                  # the hand-offs are in order
            if w == "<env>":
                assert words[t - 1] == "</act>"
            if w == "</env>" and t + 1 < len(words):
                assert words[t + 1] == "<act>"
    # the planned call was forced, the toy world answered it for real
    assert rows[0]["calls"][0] == "price apple" and rows[0]["responses"][0] == "3"
    assert " ".join(tok.convert_ids_to_tokens(rows[0]["ids"][3:10])) == "<act> price apple </act> <env> 3 </env>"


def test_generate_baseline_gives_episodes_of_our_samplers_kind():
    """Rehearse mode with a planned call: the hand-off is forced before the rehearsal's generate
    call, so both baselines' rows rehearse after <env> exactly as our sampler's do."""
    tok = toy_tokenizer()
    model = tiny_llama(tok)
    plans = [[("price apple", "3")]] * 3
    ends, generate = [], model.generate
    model.generate = lambda input_ids, **kw: ends.append(input_ids[:, -1].tolist()) or generate(input_ids=input_ids, **kw)
    rows = speed.generate_episodes(model, tok, ["price apple"] * 3, "rehearse", speed.DEFAULTS, seed=0, plans=plans)
    assert ends[0] == tok.convert_tokens_to_ids(["<env>"] * 3)          # the first call: the rehearsals
    for r in rows:
        words = tok.convert_ids_to_tokens(r["ids"][r["prompt_len"]:])
        assert words[:5] == ["<act>", "price", "apple", "</act>", "<env>"] and len(words) > 5
        assert r["roles"][r["prompt_len"] + 5] == envace.REHEARSE      # sampled by the policy, after <env>


@pytest.fixture
def no_work(monkeypatch):
    """speed.main with every workload refusing to start: an option refused by main never reaches one."""
    def started(args):
        raise AssertionError("a workload started before the options were checked")
    for name in ("toy_workload", "chat_workload", "smollm2_workload"):
        monkeypatch.setattr(speed, name, started)


def error_lines(capsys):
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.out == ""
    return captured.err.splitlines()


@pytest.mark.parametrize("argv, line", [
    (["--repeats", "0"], "--repeats must be at least 1, got 0"),
    (["--tasks", "-1"], "--tasks must be at least 1, got -1"),
    (["--group_size", "0"], "--group_size must be at least 1, got 0"),
    (["--group_size", "1"], "--group_size must be at least 2, got 1: a group of one episode is its own baseline "
                            "(A = R - mean(group) = 0), so the RL step has nothing to update"),
    (["--tasks", "201"], "--tasks must be at most 200 for the toy and chat workloads (the toy shop's RL tasks), "
                         "got 201"),
    (["--workload", "chat", "--tasks", "201"], "--tasks must be at most 200 for the toy and chat workloads (the toy "
                                               "shop's RL tasks), got 201"),
    (["--max_new", "0"], "--max_new must be at least 1, got 0"),
    (["--pad_tools", "-1"], "--pad_tools must be at least 0, got -1"),
    (["--min_seconds", "-0.5"], "--min_seconds must be a finite number >= 0, got -0.5"),
    (["--min_seconds", "nan"], "--min_seconds must be a finite number >= 0, got nan"),
    (["--peak_tflops", "inf"], "--peak_tflops must be a finite number > 0, got inf"),
    (["--repeats", "two"], "argument --repeats: invalid int value: 'two' (--help lists the options)"),
    (["--workload", "tiny"], "argument --workload: invalid choice: 'tiny' (choose from 'toy', 'chat', 'both', "
                             "'smollm2') (--help lists the options)"),
    (["--device", "gpu"], "--device must be cpu, cuda or cuda:N, got 'gpu'"),
    (["--workload", "chat", "--ckpt", "out/small/ckpt"], "--ckpt is the toy workload's model; the workloads here "
                                                          "are chat"),
    (["--out", ""], "--out is empty: give a file for the results (default out/bench.json)"),
])
def test_a_bad_option_is_one_line_before_any_work(argv, line, no_work, capsys):
    """Before: --repeats 0 timed everything, then ended in a StatisticsError traceback; nan and inf
    a traceback; a count of 0 or below the same or an empty benchmark; --group_size 1 sampled and
    timed, then a KeyError traceback (the RL step skipped every group, each its own baseline);
    --tasks 201 a benchmark of 200 tasks, the table silently not what was asked."""
    assert speed.main(argv) == 2
    assert error_lines(capsys) == [f"error: {line}"]


@pytest.mark.parametrize("argv", [["--group_size", "2"], ["--tasks", "200"], ["--tasks", "1"],
                                  ["--workload", "chat", "--tasks", "200", "--group_size", "2"]])
def test_the_edge_values_that_work_pass_the_check(argv, tmp_path, no_work, capsys):
    """The smallest group that has a baseline (2) and every count of the toy shop's 200 RL tasks
    reach the workload (here: the fixture's refusal)."""
    with pytest.raises(AssertionError, match="a workload started"):
        speed.main(argv + ["--out", str(tmp_path / "b.json")])
    assert os.listdir(tmp_path) == []


def test_a_bad_out_or_ckpt_path_is_one_line_before_any_work_and_keeps_the_users_file(tmp_path, no_work, capsys,
                                                                                      monkeypatch):
    """--out a folder (before: the whole benchmark ran, then a traceback, the figures lost), in a
    missing folder or under a file, a file that scripts/speed.py did not write (kept unless --overwrite);
    --ckpt missing or damaged: one line, exit 2, nothing written. A result of scripts/speed.py is replaced."""
    assert speed.main(["--out", str(tmp_path)]) == 2
    assert error_lines(capsys) == [f"error: --out {tmp_path} is a folder: give a file, e.g. {tmp_path / 'bench.json'}"]
    assert speed.main(["--out", str(tmp_path / "no" / "b.json")]) == 2
    assert error_lines(capsys) == [f"error: --out {tmp_path / 'no' / 'b.json'}: no folder {tmp_path / 'no'}"]
    mine = tmp_path / "notes.json"
    mine.write_text('{"my": "figures"}')
    assert speed.main(["--out", str(mine / "b.json")]) == 2
    assert error_lines(capsys) == [f"error: --out {mine / 'b.json'}: {mine} is a file, not a folder"]
    assert speed.main(["--out", str(mine)]) == 2
    assert error_lines(capsys) == [f"error: --out {mine} is already there and is not a result of scripts/speed.py: give "
                                   "another --out, or --overwrite to replace it"]
    assert speed.main(["--ckpt", str(tmp_path / "nope"), "--out", str(tmp_path / "b.json")]) == 2
    assert error_lines(capsys) == [f"error: --ckpt {tmp_path / 'nope'}: no such folder"]
    (tmp_path / "ckpt").mkdir()
    assert speed.main(["--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "b.json")]) == 2
    assert error_lines(capsys) == [f"error: --ckpt {tmp_path / 'ckpt'}: {tmp_path / 'ckpt' / 'config.json'} is missing"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "notes.json"] and mine.read_text() == '{"my": "figures"}'
    result = {"device": "cpu", "threads": 1, "repeats": 1, "min_seconds": 0.0}
    monkeypatch.setattr(speed, "run_workloads", lambda args, workloads: {**result, "workloads": workloads})
    assert speed.main(["--out", str(mine), "--overwrite", "--workload", "toy"]) == 0
    assert json.loads(mine.read_text()) == {**result, "workloads": ["toy"]}
    assert speed.main(["--out", str(mine), "--workload", "chat"]) == 0          # scripts/speed.py's own result: replaced
    assert json.loads(mine.read_text()) == {**result, "workloads": ["chat"]}
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "notes.json"]


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_a_signal_during_the_benchmark_is_one_line_and_keeps_the_earlier_result(tmp_path, monkeypatch, capsys,
                                                                                 signum, sigterm_guard):
    import signal
    out = tmp_path / "bench.json"
    out.write_text('{"device": "cpu", "threads": 1, "repeats": 1, "min_seconds": 0.0}')

    def interrupted(args, workloads):
        os.kill(os.getpid(), getattr(signal, signum))
        return {}
    monkeypatch.setattr(speed, "run_workloads", interrupted)
    assert speed.main(["--out", str(out)]) == 130
    assert [x for x in capsys.readouterr().err.splitlines() if x] == [f"interrupted: nothing written to {out}"]
    assert os.listdir(tmp_path) == ["bench.json"]
    assert out.read_text() == '{"device": "cpu", "threads": 1, "repeats": 1, "min_seconds": 0.0}'
