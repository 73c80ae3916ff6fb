"""The oracle: every task's gold calls replayed through its executor and scored by its own reward.

A check of the benchmark's plumbing, not of a model: a task file whose tasks give `gold_calls`
and an executor (`env`: "toy" or "MODULE:CLASS", chat/executor.py) should score 1.0 when exactly the
gold calls are made, turn by turn. Each task's gold calls are run through the same world the
evaluation uses (chat.task_world: the toy world, or executor.call_tool on a fresh
CLASS(**env_config)), the episode is built as the sampler would build it (calls, responses,
call_turns, answers: an empty answer per turn, the task's `answer` last) and scored with
chat_reward.chat_reward, the reward path of training and evaluation (the task's own `check`
when it names one). Tasks without gold calls or an executor are not replayed.

    python evaluate.py --oracle --test_file=data/bfcl/multi_turn_base.jsonl --out_dir=out/oracle

Writes OUT_DIR/oracle.json (not eval.json, so that an out_dir holding a train.py run keeps its
eval.json): success (mean reward over the replayed tasks), n_tasks, executed_tasks, and
`failures` (per task scoring under 1: its line, reward, and the first error response of its
replay); each failure is also printed. It is written whole once every task is scored, or not at
all (Ctrl-C / SIGTERM: exit 130, one line); a task's check returning a reward outside [0, 1], or
raising, is one line naming the task (exit 2).
"""
import json
import os
import sys

from chat import format as chat
from chat import tasks as chat_tasks
from machinery import taskfiles
from chat.chat_reward import chat_reward
from machinery.checkpoint import write_file
from machinery.config import DEFAULTS, ArgumentParser, ConfigError, check_value
from chat.executor import is_error
from machinery.faults import error_line, sigterm_as_interrupt

RESULT = "oracle.json"      # not eval.json: --out_dir may be a run of train.py, whose eval.json stays


def gold_turns(task):
    """The task's gold calls per user turn (a flat list is one turn)."""
    gold = task["gold_calls"]
    return [gold] if gold and all(isinstance(c, dict) for c in gold) else gold


def oracle_episode(task, tool_timeout=DEFAULTS["tool_timeout"]):
    """The episode that makes exactly the task's gold calls, each answered by its executor."""
    world = chat.task_world(task, {}, tool_timeout)      # only new_state and step are used: no tags
    state = world.new_state()
    calls, responses, call_turns = [], [], []
    turns = gold_turns(task)
    for k, turn in enumerate(turns):
        for call in turn:
            text = json.dumps({"name": call["name"], "arguments": call["arguments"]}, ensure_ascii=False)
            calls.append(text)
            responses.append(world.step(state, text))
            call_turns.append(k)
    answer = task.get("answer", "")
    return {"calls": calls, "responses": responses, "call_turns": call_turns,
            "answers": [""] * (len(turns) - 1) + [answer], "answer": answer, "cause": "answer"}


def run_oracle(test_file, tool_timeout=DEFAULTS["tool_timeout"]):
    """The eval.json dict of the oracle on one chat task file (ConfigError for a bad file)."""
    try:
        tasks = chat_tasks.read_chat_jsonl(test_file, "tasks")
    except taskfiles.DataError as e:
        raise ConfigError(str(e)) from None
    replayed = [(n, t) for n, t in enumerate(tasks, 1) if t.get("gold_calls") and chat.has_executor(t)]
    if not replayed:
        raise ConfigError(f"{test_file}: no task with gold_calls and an executor ('env') to replay")
    rewards, failures = [], []
    for n, task in replayed:
        episode = oracle_episode(task, tool_timeout)
        rewards.append(chat_reward(episode, task))
        if rewards[-1] < 1.0:
            error = next((r for r in episode["responses"] if is_error(r)), None)
            failures.append({"line": n, "reward": rewards[-1], "first_error": error})
    return {"success": sum(rewards) / len(rewards), "n_tasks": len(tasks), "executed_tasks": len(replayed),
            "failures": failures}


def main(argv):
    """evaluate.py --oracle: --test_file=F --out_dir=D -> exit status: 0 written; 2 a user mistake
    (a bad task file, option or check, an unwritable out_dir); 1 anything else (one line naming
    it; user code exiting too); 130 Ctrl-C / SIGTERM (nothing written). Each one line."""
    try:
        args = command_line(argv)                 # (--help prints and exits 0 here)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    phase = "the oracle's replay"
    try:
        sigterm_as_interrupt()                # SIGTERM too: KeyboardInterrupt at once
        result = run_oracle(args.test_file, args.tool_timeout)
        for f in result["failures"]:
            why = f"first error response {f['first_error'][:120]}" if f["first_error"] else "no error response"
            print(f"{args.test_file} line {f['line']}: reward {f['reward']:.3f} ({why})")
        phase, path = "writing the result", os.path.join(args.out_dir, RESULT)
        write_file(path, json.dumps(result, indent=1))      # whole or not at all
    except KeyboardInterrupt:
        print(f"\ninterrupted during {phase}: nothing written", file=sys.stderr)
        return 130
    except ConfigError as e:                      # CheckpointError (an unwritable out_dir) is one too
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (Exception, SystemExit) as e:          # a library, user code raising or exiting: one line
        print(error_line(e, phase), file=sys.stderr)
        return 1
    print(f"oracle success {result['success']:.3f} on {result['executed_tasks']} replayed of "
          f"{result['n_tasks']} tasks; written to {path}")
    return 0


def command_line(argv):
    """The oracle's options, checked: ConfigError (one line) for a missing or bad one."""
    parser = ArgumentParser(prog="evaluate.py --oracle", description=__doc__.split("\n")[0])
    parser.add_argument("--test_file", required=True, help="a chat task file with gold_calls and env")
    parser.add_argument("--out_dir", required=True, help=f"where {RESULT} is written")
    parser.add_argument("--tool_timeout", type=float, default=DEFAULTS["tool_timeout"])
    args = parser.parse_args(argv)
    if not args.out_dir:
        raise ConfigError("--out_dir is empty: give the folder for " + RESULT)
    args.tool_timeout = check_value("tool_timeout", args.tool_timeout)     # > 0 and finite, as the key
    return args
