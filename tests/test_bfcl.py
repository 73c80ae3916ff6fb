"""BFCL-v4 multi-turn (bfcl.py): the converter, the executor, the check against the package's own
checker, and the oracle through evaluate.py. Every test that reads BFCL's data or classes needs
bfcl-eval (installed by .ci/run; helpers.needs: skipped where it is missing, a failure under CI);
the schema mapping, the call parser and the refusal without the package need nothing."""
from scripts import evaluate_cli
import builtins
import itertools
import json
import os

import pytest

from benchmarks import bfcl
from machinery.config import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from helpers import needs


@pytest.fixture(scope="module")
def bfcl_dir(tmp_path_factory):
    needs("bfcl_eval")
    out = tmp_path_factory.mktemp("bfcl")
    assert bfcl.convert(str(out)) == {"multi_turn_base": 200, "multi_turn_base_rl": 160,
                                      "multi_turn_base_heldout": 40, "multi_turn_base_rl_logged": 160,
                                      "multi_turn_miss_param": 200,
                                      "multi_turn_long_context": 200}
    return out


def lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def base(bfcl_dir):
    return lines(bfcl_dir / "multi_turn_base.jsonl")


def gold_episode(task):
    """The episode that makes exactly the ground truth's calls, turn by turn, and answers each turn."""
    calls = [c for turn in task["gold_calls"] for c in turn]
    return {"calls": [json.dumps(c) for c in calls],
            "call_turns": [k for k, turn in enumerate(task["gold_calls"]) for _ in turn],
            "answers": ["done"] * len(task["gold_calls"]), "answer": "done", "cause": "answer"}


# ----------------------------------------------------------------------------- the converter

def test_json_schema_maps_bfcl_types_through_properties_and_items():
    doc = {"type": "dict", "properties": {
        "price": {"type": "float", "description": "p"},
        "pairs": {"type": "tuple", "items": {"type": "dict", "properties": {"x": {"type": "any"}}}},
        "n": {"type": "integer", "default": 3}}, "required": ["price"]}
    assert bfcl.json_schema(doc) == {"type": "object", "properties": {
        "price": {"type": "number", "description": "p"},
        "pairs": {"type": "array", "items": {"type": "object", "properties": {"x": {}}}},
        "n": {"type": "integer", "default": 3}}, "required": ["price"]}


def test_parse_call_names_positional_arguments_and_never_runs_code():
    docs = {"post_tweet": {"parameters": {"properties": {"content": {}, "tags": {}, "mentions": {}}}}}
    assert bfcl.parse_call("post_tweet('hi', mentions=['@a'], tags=[])", docs) == {
        "name": "post_tweet", "arguments": {"content": "hi", "mentions": ["@a"], "tags": []}}
    assert bfcl.parse_call("post_tweet(content=(1, 2))", docs)["arguments"] == {"content": [1, 2]}
    with pytest.raises(ValueError):                   # a call inside an argument is not a literal
        bfcl.parse_call("post_tweet(content=__import__('os').getcwd())", docs)
    with pytest.raises(ValueError):
        bfcl.parse_call("os.system('ls')", docs)


def test_converter_writes_the_first_base_task_as_a_multi_turn_chat_task(bfcl_dir, base):
    assert not (bfcl_dir / "multi_turn_miss_func.jsonl").exists()
    t = base[0]
    assert t["id"] == "multi_turn_base_0" and t["family"] == "multi_turn_base"
    assert [m["role"] for m in t["messages"]] == ["system", "user"]
    assert t["messages"][0]["content"] == bfcl.SYSTEM
    assert t["messages"][1]["content"].startswith("Move 'final_report.pdf' within document directory")
    assert len(t["turns"]) == 3 and t["turns"][0][0]["content"].startswith("Perform a detailed search")
    assert t["gold_calls"][0] == [{"name": "cd", "arguments": {"folder": "document"}},
                                  {"name": "mkdir", "arguments": {"dir_name": "temp"}},
                                  {"name": "mv", "arguments": {"source": "final_report.pdf", "destination": "temp"}}]
    assert t["gold_calls"][2] == [{"name": "sort", "arguments": {"file_name": "final_report.pdf"}}]  # was positional
    names = [tool["function"]["name"] for tool in t["tools"]]
    assert len(names) == 31 and "post_tweet" in names and "mv" in names and "cp" not in names  # cp is excluded
    mv = next(tool for tool in t["tools"] if tool["function"]["name"] == "mv")["function"]["parameters"]
    assert mv["type"] == "object" and mv["required"] == ["source", "destination"]
    assert t["env"] == "benchmarks.bfcl:BFCLEnv" and t["check"] == "benchmarks.bfcl:check"
    assert t["env_config"]["involved_classes"] == ["TwitterAPI", "GorillaFileSystem"]
    assert "long_context" not in t["env_config"]
    heldout, rl = lines(bfcl_dir / "multi_turn_base_heldout.jsonl"), lines(bfcl_dir / "multi_turn_base_rl.jsonl")
    assert [t["id"] for t in heldout[:3]] == ["multi_turn_base_0", "multi_turn_base_5", "multi_turn_base_10"]
    assert [t["id"] for t in rl[:5]] == [f"multi_turn_base_{k}" for k in (1, 2, 3, 4, 6)]
    assert sorted(t["id"] for t in heldout + rl) == sorted(t["id"] for t in base)
    long = lines(bfcl_dir / "multi_turn_long_context.jsonl")[0]
    assert long["env_config"]["long_context"] is True
    assert len(lines(bfcl_dir / "multi_turn_miss_param.jsonl")[0]["gold_calls"]) == 5   # a turn asks for the parameter


def test_every_converted_line_passes_check_task(bfcl_dir):
    from chat import tasks as chat_tasks
    for category in ("multi_turn_base", "multi_turn_miss_param", "multi_turn_long_context"):
        tasks = chat_tasks.read_chat_jsonl(str(bfcl_dir / f"{category}.jsonl"), "tasks")
        assert len(tasks) == 200
        assert all(len(t["gold_calls"]) == 1 + len(t.get("turns", [])) for t in tasks)
        assert tasks[0]["check"] == "benchmarks.bfcl:check" and tasks[0]["env_config"]["involved_classes"]


def test_missing_package_refuses_bfcl_only_with_the_install_line(monkeypatch, tmp_path):
    """Runs whether or not bfcl-eval is installed (its import is refused here): a BFCL task line
    (one tool, the BFCL env and check) is refused with the install line, other tasks load."""
    from chat import tasks as chat_tasks
    from machinery.taskfiles import DataError
    task = tmp_path / "bfcl_task.jsonl"
    task.write_text(json.dumps({
        "messages": [{"role": "user", "content": "list the files"}], "gold_calls": [{"name": "ls", "arguments": {}}],
        "tools": [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}}],
        "env": "benchmarks.bfcl:BFCLEnv", "env_config": {"initial_config": {}, "involved_classes": ["GorillaFileSystem"]},
        "check": "benchmarks.bfcl:check"}) + "\n")
    real_import = builtins.__import__

    def no_bfcl(name, *args, **kwargs):
        if name.startswith("bfcl_eval"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_bfcl)
    with pytest.raises(ConfigError, match=r"pip install --no-deps bfcl-eval==2026\.3\.23 mpmath"):
        bfcl.convert(str(tmp_path))
    with pytest.raises(ConfigError, match="bfcl-eval package, not installed"):
        bfcl.BFCLEnv({}, ["GorillaFileSystem"])
    assert bfcl.main(["--out", str(tmp_path)]) == 2
    with pytest.raises(DataError, match=r"line 1: env 'benchmarks.bfcl:BFCLEnv': BFCLEnv\(\*\*env_config\) raised ConfigError: "
                                        r"BFCL tasks need the bfcl-eval package, not installed: pip install --no-deps"):
        chat_tasks.read_chat_jsonl(str(task), "tasks")
    toy = os.path.join(os.path.dirname(__file__), "..", "data", "toy_chat_example.jsonl")
    assert len(chat_tasks.read_chat_jsonl(toy, "tasks")) == 6                                   # other tasks load
    assert bfcl.json_schema({"type": "float"}) == {"type": "number"}      # the rest still works


def test_an_optional_package_missing_skips_locally_and_fails_under_ci(monkeypatch):
    def outcome():                        # pytest's skip and fail are BaseExceptions: catch either
        try:
            needs("no_such_package")
        except BaseException as e:
            return type(e), str(e)
    monkeypatch.delenv("CI", raising=False)
    assert needs("json") is json
    kind, message = outcome()
    assert kind is pytest.skip.Exception and message.startswith("no_such_package is not installed")
    monkeypatch.setenv("CI", "1")
    kind, message = outcome()
    assert kind is pytest.fail.Exception and "no_such_package is not installed" in message and "CI is set" in message


def test_no_test_skips_but_through_needs():
    """A skip anywhere else (importorskip, skipif, pytest.skip) would pass silently under CI."""
    here = os.path.dirname(os.path.abspath(__file__))
    found = []
    for name in sorted(os.listdir(here)):
        if name.endswith(".py") and name not in ("helpers.py", os.path.basename(__file__)):
            text = open(os.path.join(here, name)).read()
            found += [(name, w) for w in ("importorskip", "skipif", "pytest.skip(", "mark.skip") if w in text]
    assert found == []


# ----------------------------------------------------------------------------- the executor

def test_bfcl_env_dispatches_tools_by_name_on_fresh_instances(base):
    cfg = base[0]["env_config"]
    env, other = bfcl.BFCLEnv(**cfg), bfcl.BFCLEnv(**cfg)
    assert list(env.instances) == ["TwitterAPI", "GorillaFileSystem"]
    assert env.cd(folder="document") == {"current_working_directory": "document"}
    assert env.pwd() == {"current_working_directory": "/workspace/document"}
    assert other.pwd() == {"current_working_directory": "/workspace"}       # its own state
    assert env.posting_get_login_status() == {"login_status": False}         # the other class
    assert bfcl.execution_result(env, {"name": "cd", "arguments": {"folder": "nope"}}) == \
        '{"error": "cd: \'nope\': No such file or directory"}'
    assert bfcl.execution_result(env, {"name": "cd", "arguments": {"nope": 1}}).startswith(
        "Error during execution: GorillaFileSystem.cd() got an unexpected keyword argument 'nope'")
    for name in ("_load_scenario", "__class__x", "no_such_tool"):
        with pytest.raises(AttributeError):
            getattr(env, name)
    # the initial config is deep-copied: the file system of a new env is as loaded
    env.mkdir(dir_name="made_here")
    assert "made_here" not in bfcl.BFCLEnv(**cfg).ls()["current_directory_content"]


# ----------------------------------------------------------------------------- the check

def test_check_passes_the_ground_truth_and_fails_an_unfinished_episode(base):
    assert all(bfcl.check(t, gold_episode(t)) == 1.0 for t in base)
    t = base[0]
    short = {**gold_episode(t), "answers": ["done"] * 3, "cause": "max_turns"}
    assert bfcl.mismatch(t, short) == "the episode finished 3 of 4 turns"
    nothing = {**gold_episode(t), "calls": [], "call_turns": []}
    assert bfcl.mismatch(t, nothing) == "turn 0: no call made; the ground truth makes 3"


def test_check_reads_state_and_results_as_hand_computed(base):
    t = base[0]
    episode = gold_episode(t)
    # the first turn without the mkdir: the mv renames the file to 'temp' instead
    calls, turns = episode["calls"][:1] + episode["calls"][2:], episode["call_turns"][:1] + episode["call_turns"][2:]
    assert bfcl.mismatch(t, {**episode, "calls": calls, "call_turns": turns}) == \
        "turn 0: GorillaFileSystem.root differs from the ground truth's"
    # the grep of turn 1 moved to turn 2: turn 1's state matches but its result is missing
    grep = episode["calls"][4]
    moved = {**episode, "call_turns": [0, 0, 0, 1, 2, 2, 3, 3, 3, 3]}
    assert json.loads(grep)["name"] == "grep"
    assert bfcl.mismatch(t, moved).startswith("turn 1: the ground truth's result '{\"matching_lines\"")
    # a result made in an earlier turn counts for a later one (the official all-turns list): the
    # sort done in turn 1 already, turn 2 only asks pwd (no state change)
    sort, pwd = episode["calls"][5], json.dumps({"name": "pwd", "arguments": {}})
    early = {**episode, "calls": episode["calls"][:5] + [sort, pwd] + episode["calls"][6:],
             "call_turns": [0, 0, 0, 1, 1, 1, 2, 3, 3, 3, 3]}
    assert bfcl.mismatch(t, early) is None
    late_only = {**early, "calls": early["calls"][:5] + early["calls"][6:], "call_turns": [0, 0, 0, 1, 1, 2, 3, 3, 3, 3]}
    assert bfcl.mismatch(t, late_only).startswith("turn 2: the ground truth's result '{\"sorted_content\"")

EXTRA = {"GorillaFileSystem": {"name": "touch", "arguments": {"file_name": "extra_file.txt"}},
         "MessageAPI": {"name": "add_contact", "arguments": {"user_name": "extra_user"}},
         "TradingBot": {"name": "fund_account", "arguments": {"amount": 1.0}},
         "VehicleControlAPI": {"name": "setHeadlights", "arguments": {"mode": "on"}}}
_RUNS = itertools.count()


def official(task, episode):
    """The package's own multi_turn_checker on the same episode: each call a step of its turn,
    written as a Python call string; a fresh model name per run (it caches instances by name)."""
    model_turns, _, _ = bfcl.episode_turns(task, episode)
    strings = [[[f"{c['name']}({', '.join(f'{k}={v!r}' for k, v in c['arguments'].items())})"] for c in turn]
               for turn in model_turns]
    gold = [[f"{c['name']}({', '.join(f'{k}={v!r}' for k, v in c['arguments'].items())})" for c in turn]
            for turn in task["gold_calls"]]
    entry = {"id": task["id"], "initial_config": task["env_config"]["initial_config"],
             "involved_classes": task["env_config"]["involved_classes"]}
    multi_turn_checker = needs("bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker").multi_turn_checker
    return 1.0 if multi_turn_checker(strings, gold, entry, "multi_turn_base", f"envace_x{next(_RUNS)}")["valid"] else 0.0


def perturbed(task):
    """{what: episode}: the ground truth, its last call dropped, one argument wrong, and an extra
    state-changing call at the end (when a class of EXTRA is involved)."""
    episode = gold_episode(task)
    calls, turns = episode["calls"], episode["call_turns"]
    out = {"ground truth": episode,
           "dropped call": {**episode, "calls": calls[:-1], "call_turns": turns[:-1]}}
    for k, text in enumerate(calls):
        call = json.loads(text)
        key = next((a for a, v in call["arguments"].items() if isinstance(v, str)), None)
        if key:
            call["arguments"][key] += "_wrong"
            out["wrong argument"] = {**episode, "calls": calls[:k] + [json.dumps(call)] + calls[k + 1:]}
            break
    cls = next((c for c in task["env_config"]["involved_classes"] if c in EXTRA), None)
    if cls:
        out["extra call"] = {**episode, "calls": calls + [json.dumps(EXTRA[cls])], "call_turns": turns + [turns[-1]]}
    return out


def test_check_agrees_with_the_official_checker_on_perturbed_trajectories(base):
    seen = {}
    for i in (0, 1, 2, 3, 50, 51, 52, 100, 101, 102, 150, 151, 152, 199):
        task = base[i]
        for what, episode in perturbed(task).items():
            ours, theirs = bfcl.check(task, episode), official(task, episode)
            assert ours == theirs, (task["id"], what, bfcl.mismatch(task, episode))
            seen.setdefault(what, []).append(ours)
    assert seen["ground truth"] == [1.0] * 14
    # task 50's ground truth ends by turning the headlights on: one more setHeadlights on changes nothing
    assert seen["extra call"] == [0.0] * 4 + [1.0] + [0.0] * 6
    assert sum(seen["dropped call"]) < 14 and sum(seen["wrong argument"]) < len(seen["wrong argument"])



def test_missing_results_counts_duplicates_and_leaves_the_model_results_alone():
    """Each model result covers one ground-truth result: two equal ground-truth results need two
    equal model results; the model's list is not consumed (a later turn reads it whole again)."""
    model = ["a", "b"]
    assert bfcl.missing_results(["a", "a"], model) == ["a"]
    assert bfcl.missing_results(["a", "b", "a"], ["b", "a"]) == ["a"]
    assert bfcl.missing_results(["a", "a"], ["a", "b", "a"]) == []
    assert bfcl.missing_results(["a"], ["a", "a"]) == []
    assert bfcl.missing_results(["a", "b"], model) == [] and bfcl.missing_results(["a", "b"], model) == []
    assert model == ["a", "b"]


def test_check_with_duplicate_results_agrees_with_the_official_checker(base):
    """Task 0 with its third turn's ground truth sorting the report twice (the same result twice):
    the model sorting it once misses one (fails), twice passes. And with the last turn's ground
    truth ending with that sort too: the model's one sort of turn 2 is among its results in turn 3
    as well (the official checker reads all results so far, each turn anew): it passes."""
    t = base[0]
    sort = {"name": "sort", "arguments": {"file_name": "final_report.pdf"}}
    twice = {**t, "gold_calls": t["gold_calls"][:2] + [[sort, sort]] + t["gold_calls"][3:]}
    episode = gold_episode(t)                          # one sort in turn 2
    doubled = gold_episode(twice)
    assert [json.loads(c)["name"] for c in doubled["calls"]].count("sort") == 2
    assert bfcl.mismatch(twice, episode).startswith("turn 2: the ground truth's result '{\"sorted_content\"")
    assert (bfcl.check(twice, episode), official(twice, episode)) == (0.0, 0.0)
    assert (bfcl.check(twice, doubled), official(twice, doubled)) == (1.0, 1.0)
    again = {**t, "gold_calls": t["gold_calls"][:3] + [t["gold_calls"][3] + [sort]]}
    assert bfcl.mismatch(again, episode) is None
    assert official(again, episode) == 1.0

def test_a_parameter_the_ground_truth_breaks_also_takes_its_type(base):
    t = base[173]                            # close_ticket(ticket_id='ticket_001'), documented integer
    close = next(x for x in t["tools"] if x["function"]["name"] == "close_ticket")["function"]["parameters"]
    assert close["properties"]["ticket_id"]["type"] == ["integer", "string"]
    assert t["gold_calls"][3] == [{"name": "close_ticket", "arguments": {"ticket_id": "ticket_001"}}]
    other = next(x for x in base[2]["tools"] if x["function"]["name"] == "close_ticket")["function"]["parameters"]
    assert other["properties"]["ticket_id"]["type"] == "integer"            # only where it is broken


# ----------------------------------------------------------------------------- task files, reward

def write_task(tmp_path, row):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return str(path)


def test_check_task_reads_turns_gold_calls_per_turn_and_check(base, tmp_path):
    from chat import tasks as chat_tasks
    from machinery.taskfiles import DataError
    row = {k: base[1][k] for k in ("messages", "turns", "tools", "gold_calls", "env", "env_config", "check")}
    task = chat_tasks.read_chat_jsonl(write_task(tmp_path, row), "tasks")[0]
    assert task["check"] == "benchmarks.bfcl:check" and len(task["turns"]) == 3 and task["env_class"] is bfcl.BFCLEnv
    assert [len(t) for t in task["gold_calls"]] == [1, 2, 2, 1]
    (tmp_path / "mycheck.py").write_text("def score(task, episode):\n    return 0.5\n")
    task = chat_tasks.read_chat_jsonl(write_task(tmp_path, {**row, "check": "mycheck.py:score"}), "tasks")[0]
    assert task["check"] == f"{tmp_path / 'mycheck.py'}:score"          # absolute: loads from anywhere
    bad = {"gold_calls": (row["gold_calls"][:3], "'gold_calls' has 3 turns but the task has 4 user turns "
                                                 "(the opening and 3 in 'turns')"),
           "turns": ([[{"role": "assistant", "content": "x"}]] * 3, "turn 1 of 'turns', message 1: expected"),
           "check": ("benchmarks.bfcl:nope", "'check' 'benchmarks.bfcl:nope': benchmarks.bfcl has no class or function 'nope'")}
    for key, (value, message) in bad.items():
        with pytest.raises(DataError, match=f"t.jsonl line 1: {message}".replace("(", r"\(").replace(")", r"\)")):
            chat_tasks.read_chat_jsonl(write_task(tmp_path, {**row, key: value}), "tasks")


def test_chat_reward_scores_a_task_by_its_own_check(base, tmp_path):
    from chat import tasks as chat_tasks
    from chat import chat_reward
    row = {k: base[0][k] for k in ("messages", "turns", "tools", "gold_calls", "env", "env_config", "check")}
    task = chat_tasks.read_chat_jsonl(write_task(tmp_path, row), "tasks")[0]
    episode = gold_episode(task)
    assert chat_reward.chat_reward(episode, task) == 1.0
    assert chat_reward.chat_reward({**episode, "calls": episode["calls"][1:], "call_turns": episode["call_turns"][1:]},
                                   task) == 0.0             # no cd: the mkdir is made in the wrong folder
    assert chat_reward.chat_reward({**episode, "cause": "bad_call_json"}, task) == 0.0
    (tmp_path / "half.py").write_text("def score(task, episode):\n    return 0.5\n")
    half = chat_tasks.read_chat_jsonl(write_task(tmp_path, {**row, "check": "half.py:score",
                                                      "checklist": ["Was it polite?"]}), "tasks")[0]
    assert chat_reward.chat_reward(episode, half) == 0.5                   # the check, not gold call matching
    assert chat_reward.chat_reward(episode, half, judge=lambda e, t: [0.8]) == pytest.approx(0.4)


def test_a_prompt_that_does_not_fit_max_tokens_is_one_line(base, bfcl_dir):
    from chat import format as chat
    from chat import setup as chat_setup
    from chat import tasks as chat_tasks
    from machinery.config import DEFAULTS
    from helpers import chat_tokenizer
    tokenizer = chat_tokenizer()
    task = chat_tasks.read_chat_jsonl(str(bfcl_dir / "multi_turn_base_heldout.jsonl"), "tasks")[0]   # base task 0
    opening = len(chat.prompt_ids(tokenizer, task["messages"], task["tools"]))
    with pytest.raises(ConfigError) as e:
        chat_setup.check_chat_prompts({**DEFAULTS, "max_tokens": 4096}, tokenizer, [task])
    prefix = ("max_tokens (4096) leaves no room for an episode: a task's prompt (messages + tools + later user "
              "turns) is ")
    assert str(e.value).startswith(prefix) and str(e.value).endswith(""" tokens ("Move 'final_report.pdf' within document ")""")
    assert int(str(e.value)[len(prefix):].split()[0]) > opening > 4096       # the later turns counted too


# ----------------------------------------------------------------------------- the oracle

def test_oracle_scores_every_base_task_through_evaluate(bfcl_dir, tmp_path, capsys):
    out = tmp_path / "oracle"
    assert evaluate_cli.main(["--oracle", f"--test_file={bfcl_dir / 'multi_turn_base.jsonl'}", f"--out_dir={out}"]) == 0
    result = json.loads((out / "oracle.json").read_text())
    assert (result["success"], result["n_tasks"], result["executed_tasks"], result["failures"]) == (1.0, 200, 200, [])
    assert capsys.readouterr().out.strip() == f"oracle success 1.000 on 200 replayed of 200 tasks; written to {out / 'oracle.json'}"


def test_oracle_lists_a_failing_task_and_refuses_a_file_it_cannot_replay(base, tmp_path, capsys):
    row = {k: base[0][k] for k in ("messages", "turns", "tools", "gold_calls", "env", "env_config", "check")}
    # a check that fails an episode with an error response; the second task's gold cd goes nowhere
    (tmp_path / "strict.py").write_text("def score(task, episode):\n"
                                        "    return 0.0 if any('error' in r for r in episode['responses']) else 1.0\n")
    row["check"] = "strict.py:score"
    wrong = {**row, "gold_calls": [[{"name": "cd", "arguments": {"folder": "nowhere"}}]] + row["gold_calls"][1:]}
    path = tmp_path / "two.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps(wrong) + "\n")
    assert evaluate_cli.main(["--oracle", f"--test_file={path}", f"--out_dir={tmp_path / 'o'}"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == (f"{path} line 2: reward 0.000 (first error response "
                          "{\"error\": \"cd: 'nowhere': No such file or directory\"})")
    result = json.loads((tmp_path / "o" / "oracle.json").read_text())
    assert (result["success"], result["executed_tasks"]) == (0.5, 2)
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({k: row[k] for k in ("messages", "tools")} | {"answer": "7"}) + "\n")
    assert evaluate_cli.main(["--oracle", f"--test_file={plain}", f"--out_dir={tmp_path / 'p'}"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {plain}: no task with gold_calls and an executor ('env') to replay"


# ----------------------------------------------------------------------------- a tiny model, end to end

def test_a_tiny_random_qwen2_runs_the_bfcl_path_end_to_end_and_scores_0(bfcl_dir, base, tmp_path, capsys,
                                                                         monkeypatch):
    """The two multi_turn_base tasks with the shortest prompts (~9.5k characters: every tool doc
    of their classes) through train.py and evaluate.py on a random 2-layer Qwen2: the executor and
    the check load per line, the long prompts fit max_tokens and the model's positions, both tasks
    are executed in evaluation, and an untrained model scores 0 (the check can fail), before and
    after RL.
    Plumbing only: such a model never finishes a turn (docs/bfcl.md). The RL step trains on
    rewards 1, 0 in each group (the check's 0s would skip it) and keeps the ratio-1 invariants."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import train
    from helpers import POSITION_INIT, assert_ratio_one, chat_tokenizer
    real_rows = train.training_rows
    monkeypatch.setattr(train, "training_rows", lambda episodes, rewards, groups, how: real_rows(
        episodes, [float(i % 2 == 0) for i in range(len(episodes))], groups, how))

    tok = chat_tokenizer()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32768, tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, initializer_range=POSITION_INIT))
    model.save_pretrained(tmp_path / "qwen")
    tok.save_pretrained(tmp_path / "qwen")
    tasks = tmp_path / "two.jsonl"
    with open(bfcl_dir / "multi_turn_base.jsonl") as f:      # the two shortest prompts (~5k tokens each)
        shortest = sorted(f, key=lambda line: len(json.dumps(json.loads(line)["tools"])))[:2]
    tasks.write_text("".join(shortest))
    cfg = tmp_path / "bfcl_tiny.yaml"
    cfg.write_text(f"format: chat\nmodel: {tmp_path / 'qwen'}\ntasks_file: {tasks}\nout_dir: {tmp_path / 'run'}\n"
                   "sft_steps: 0\nrl_steps: 1\ntasks_per_step: 2\ngroup_size: 2\nmax_act_tokens: 6\n"
                   "max_env_tokens: 6\nmax_tokens: 16384\nmicro_batch_tokens: 40000\nmin_fidelity: 0.0\n"
                   "n_collusion: 1\n")
    assert train.main(["--config", str(cfg)]) == 0
    [line] = [json.loads(text) for text in open(tmp_path / "run" / "metrics.jsonl")]
    assert line["reward"] == 0.0 and line["all_equal_groups"] == 0 and line["rows_updated"] == 4
    assert_ratio_one([line])
    result = json.load(open(tmp_path / "run" / "eval.json"))
    assert result["executed_tasks"] == result["n_tasks"] == 2
    assert result["success"] == result["before"]["success"] == 0.0
    assert "real-world success 0.000 -> 0.000" in capsys.readouterr().out
    assert evaluate_cli.main(["--ckpt", str(tmp_path / "run")]) == 0
    assert json.load(open(tmp_path / "run" / "evaluate.json"))["success"] == 0.0


def test_the_qwen3_bfcl_recipe_warm_starts_on_the_logged_gold_then_trains_at_tiny_size(bfcl_dir, tmp_path, capsys,
                                                                                      monkeypatch):
    """configs/bfcl-qwen3-1.7b.yaml, the GPU recipe, with the model swapped for a random 2-layer Qwen2
    on the chat tokenizer and the budgets shrunk (one warm-start step of one logged conversation, one
    RL step of one task x 2, two held-out tasks, acts of 8 tokens; the first 8 RL tasks and their
    logged conversations, as files of the same form): the warm start trains on the logged gold
    conversations bfcl.py writes, the RL step updates (rewards 1, 0: the check's 0s would skip it)
    and both held-out tasks are executed. With max_act_tokens 8 every task's gold call is longer than
    an act may be: the warning line counts all 8 RL and both test tasks."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import train
    from helpers import POSITION_INIT, chat_tokenizer
    real_rows = train.training_rows
    monkeypatch.setattr(train, "training_rows", lambda episodes, rewards, groups, how: real_rows(
        episodes, [float(i % 2 == 0) for i in range(len(episodes))], groups, how))
    tok = chat_tokenizer()
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32768, tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        initializer_range=POSITION_INIT)).save_pretrained(tmp_path / "qwen")
    tok.save_pretrained(tmp_path / "qwen")
    for stem in ("multi_turn_base_rl", "multi_turn_base_rl_logged"):
        with open(bfcl_dir / f"{stem}.jsonl") as f:
            (tmp_path / f"{stem}.jsonl").write_text("".join(itertools.islice(f, 8)))
    out = tmp_path / "run"
    assert train.main(["--config", os.path.join(ROOT, "configs", "bfcl-qwen3-1.7b.yaml"), f"--model={tmp_path / 'qwen'}",
                       f"--out_dir={out}", f"--tasks_file={tmp_path / 'multi_turn_base_rl.jsonl'}",
                       f"--test_file={bfcl_dir / 'multi_turn_base_heldout.jsonl'}",
                       f"--logged_file={tmp_path / 'multi_turn_base_rl_logged.jsonl'}", "--sft_steps=1",
                       "--sft_batch_size=1", "--rl_steps=1", "--tasks_per_step=1", "--group_size=2", "--n_test=2",
                       "--eval_batch_size=2", "--n_collusion=0", "--max_act_tokens=8", "--max_env_tokens=8"]) == 0
    printed = capsys.readouterr()
    warnings = [line for line in printed.err.splitlines() if line.startswith("warning:")]
    assert [w.split(" tasks cannot")[0] for w in warnings] == [
        f"warning: {tmp_path / 'multi_turn_base_rl.jsonl'} (RL): 8 of 8",
        f"warning: {bfcl_dir / 'multi_turn_base_heldout.jsonl'} (test): 2 of 2"]
    assert all(" a call longer than max_act_tokens 8 (up to " in w for w in warnings)
    assert "8 logged, 8 RL, 2 test" in printed.out
    assert any(line.startswith("warm start (") for line in printed.out.splitlines())    # trained, not skipped
    assert os.path.isfile(out / "warmstart" / "config.json")
    [line] = [json.loads(text) for text in open(out / "metrics.jsonl")]
    assert line["status"] == "updated" and line["rows_updated"] == 2
    result = json.load(open(out / "eval.json"))
    assert result["executed_tasks"] == result["n_tasks"] == 2


def test_the_logged_gold_conversations_pass_the_check_and_hold_no_held_out_task(bfcl_dir):
    """multi_turn_base_rl_logged.jsonl: one logged conversation per RL task, in order, none of a
    held-out task; read as the warm start reads it (chat_tasks, `trajectories`), each replayed as an
    episode passes the task's official check. Task multi_turn_base_1 by hand: `ls(a=True)` answered
    by the file system with the workspace folder, the turn closed by "Done.", then the second user turn."""
    from chat import tasks as chat_tasks
    rl = chat_tasks.read_chat_jsonl(str(bfcl_dir / "multi_turn_base_rl.jsonl"), "tasks")
    held_out = {t["id"] for t in lines(bfcl_dir / "multi_turn_base_heldout.jsonl")}
    logged = chat_tasks.read_chat_jsonl(str(bfcl_dir / "multi_turn_base_rl_logged.jsonl"), "trajectories")
    ids = [t["id"] for t in lines(bfcl_dir / "multi_turn_base_rl_logged.jsonl")]
    assert ids == [t["id"] for t in lines(bfcl_dir / "multi_turn_base_rl.jsonl")] and not held_out & set(ids)
    for task, conversation in zip(rl, logged):
        episode = {k: conversation[k] for k in ("calls", "call_turns", "answers", "responses")}
        assert bfcl.check(task, {**episode, "cause": "answer", "answer": conversation["answer"]}) == 1.0
        assert bfcl.check(task, {**episode, "answers": episode["answers"][:-1]}) == 0.0   # a turn left unfinished
    first = lines(bfcl_dir / "multi_turn_base_rl_logged.jsonl")[0]
    assert first["id"] == "multi_turn_base_1" and first["messages"][:2] == rl[0]["messages"]
    assert first["messages"][2:6] == [
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                             "function": {"name": "ls", "arguments": {"a": True}}}]},
        {"role": "tool", "content": '{"current_directory_content": ["workspace"]}'},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": rl[0]["turns"][0][0]["content"]}]
    assert sum(a == bfcl.NO_CALL_ANSWER for t in logged for a in t["answers"]) == 1    # the one turn with no gold call
