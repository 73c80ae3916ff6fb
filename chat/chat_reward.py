"""Chat-format task success: answer match, tool calls against gold calls, a checklist judge.

The paper scores episodes with a checklist judge; BFCL compares calls AST-style. A chat task
(chat/tasks.py) gives any of: `answer` (the final answer, normalised string or number match),
`gold_calls` (the episode's calls compared AST-style: type-aware values, `call_order` exact or
any; in a multi-turn task given per user turn, the calls of turn k against those of turn k), `checklist` (yes/no questions for a local causal LM judge, scored p(yes) / (p(yes) + p(no))
of its next token), or `check` (its own success function "MODULE:FUNCTION", e.g. bfcl.py's
official BFCL check, in place of answer and gold call matching). `chat_reward` is 0 unless the
episode ended with an answer.
"""
import json
import numbers

import torch

from chat import executor
from machinery.config import ConfigError
from envace import encode


def normalise(text):
    """Lower case, whitespace collapsed, surrounding quotes/periods dropped: 'The  Apple.' -> 'the apple'."""
    return " ".join(str(text).lower().split()).strip(" .'\"")



def as_number(text):
    """'1,200' -> 1200.0, '7' -> 7.0, 'seven' -> None."""
    try:
        value = float(str(text).replace(",", "").strip())
    except ValueError:
        return None
    return value if value == value and abs(value) != float("inf") else None



def answer_match(answer, expected):
    """The final answer against the task's: numbers compare as numbers (7 == '7.0'), anything
    else as normalised strings."""
    a, b = as_number(normalise(answer)), as_number(normalise(expected))
    if a is not None and b is not None:
        return abs(a - b) <= 1e-9 * max(1.0, abs(b))
    return normalise(answer) == normalise(expected)



def value_match(got, want):
    """AST-style comparison of one argument value (BFCL's spirit): numbers by value but never a
    bool for a number (2 == 2.0, True != 1), strings normalised, lists in order, dicts by key."""
    if isinstance(want, bool) or isinstance(got, bool):
        return type(got) is type(want) and got == want
    if isinstance(want, (int, float)):
        return isinstance(got, (int, float)) and abs(got - want) <= 1e-9 * max(1.0, abs(want))
    if isinstance(want, str):
        return isinstance(got, str) and normalise(got) == normalise(want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(value_match, got, want))
    if isinstance(want, dict):
        return (isinstance(got, dict) and set(got) == set(want)
                and all(value_match(got[k], want[k]) for k in want))
    return got == want



def call_match(got, want):
    """One call {name, arguments} against a gold one: same name, same argument names, values equal."""
    return got["name"] == want["name"] and value_match(got["arguments"], want["arguments"])



def calls_match(calls, gold, order="exact"):
    """The episode's calls against the gold calls: as many, each matching; 'exact' in order,
    'any' in any order (each gold call matched by a different call)."""
    if len(calls) != len(gold):
        return False
    if order == "exact":
        return all(map(call_match, calls, gold))
    left = list(calls)
    for want in gold:
        hit = next((k for k, got in enumerate(left) if call_match(got, want)), None)
        if hit is None:
            return False
        left.pop(hit)
    return True



_CHECKS = {}                              # a task's check spec -> its function, loaded once


def checked_reward(episode, task, judge=None):
    """The reward of a task with its own `check` ("MODULE:FUNCTION", or "path.py:FUNCTION" made
    absolute at load by chat_tasks.check_task; loaded once): check(task, episode) in [0, 1] is the hard
    criterion, times the mean judge p(yes) over the checklist when a judge is given."""
    if task["check"] not in _CHECKS:
        _CHECKS[task["check"]] = executor.load_object(task["check"])
    score = checked_score(_CHECKS[task["check"]], task, episode)
    if score and judge is not None and task.get("checklist"):
        scores = judge(episode, task)
        return score * sum(scores) / len(scores)
    return score


def checked_score(check, task, episode):
    """check(task, episode) as a float in [0, 1]. A check that raises, exits, or returns anything
    else (1.5, nan, None, "yes") is a ConfigError naming the task and the value: a reward outside
    [0, 1] would move the advantages and every success figure without a word."""
    where = f"{task['where']}: " if "where" in task else ""
    try:
        score = check(task, episode)
    except executor.USER_ERRORS as e:
        raise ConfigError(f"{where}check {task['check']!r} raised {executor.error_text(e)}") from None
    if not isinstance(score, numbers.Real) or not 0 <= score <= 1:       # nan fails 0 <= nan
        raise ConfigError(f"{where}check {task['check']!r} returned {score!r}: a check returns a reward in [0, 1]")
    return float(score)


def gold_calls_match(calls, call_turns, gold, order="exact"):
    """Flat gold calls against all of the episode's calls; gold calls per user turn (a list of
    lists) turn by turn: the calls made in turn k (call_turns) against the gold calls of turn k."""
    if not gold or not isinstance(gold[0], list):
        return calls_match(calls, gold, order)
    return all(calls_match([c for c, n in zip(calls, call_turns) if n == k], want, order)
               for k, want in enumerate(gold))



def chat_reward(episode, task, judge=None):
    """Task success of a chat episode: 0 unless it ended with an answer; then 1 if every hard
    criterion the task gives holds (answer, gold_calls), times the mean judge p(yes) over the
    task's checklist when a judge is given (`judge(episode, task) -> [p(yes)]`). A task with its
    own `check` is scored by it instead (`checked_reward`)."""
    if episode["cause"] != "answer":
        return 0.0
    if "check" in task:
        return checked_reward(episode, task, judge)
    if "answer" in task and not answer_match(episode["answer"], task["answer"]):
        return 0.0
    calls = [json.loads(c) for c in episode["calls"]]
    if "gold_calls" in task and not gold_calls_match(calls, episode.get("call_turns", [0] * len(calls)),
                                                     task["gold_calls"], task.get("call_order", "exact")):
        return 0.0
    if judge is not None and task.get("checklist"):
        scores = judge(episode, task)
        return sum(scores) / len(scores)
    return 1.0



@torch.no_grad()
def judge_yes_probability(model, tokenizer, prompts):
    """For each prompt (text that ends where the judge's answer begins): p(yes) / (p(yes) + p(no))
    from the judge's next-token distribution, "yes" and "no" counting the first token of each
    casing ('yes', 'Yes' / 'no', 'No')."""
    yes = sorted({encode(tokenizer, w)[0] for w in ("yes", "Yes")})
    no = sorted({encode(tokenizer, w)[0] for w in ("no", "No")})
    device = next(model.parameters()).device
    out = []
    for prompt in prompts:
        ids = torch.tensor([encode(tokenizer, prompt)], device=device)
        probs = torch.softmax(model(input_ids=ids).logits[0, -1].float(), -1)
        p_yes, p_no = probs[yes].sum().item(), probs[no].sum().item()
        out.append(p_yes / (p_yes + p_no) if p_yes + p_no > 0 else 0.5)
    return out



def judge_prompt(tokenizer, task, transcript, question):
    """The judge's question about one episode, in its own chat template when it has one."""
    user = next((m["content"] for m in task["messages"] if m["role"] == "user"), "")
    text = (f"Task: {user}\n\nWhat the assistant did:\n{transcript}\n\nQuestion: {question}\n"
            f"Answer yes or no.")
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return text + "\nAnswer:"



def make_judge(model, tokenizer):
    """judge(episode, task) -> [p(yes) per checklist question] for chat_reward."""
    def judge(episode, task):
        turns = episode.get("call_turns", [0] * len(episode["calls"]))
        lines = []
        for k, answer in enumerate(episode.get("answers") or [episode["answer"]]):   # one block per user turn
            if k:
                lines += [f"user: {m['content']}" for m in task["turns"][k - 1]]
            lines += [f"call: {c}\nresult: {r}" for c, r, n in zip(episode["calls"], episode["responses"], turns)
                      if n == k]
            lines.append(f"answer: {answer}")
        transcript = "\n".join(lines)
        return judge_yes_probability(model, tokenizer, [judge_prompt(tokenizer, task, transcript, q)
                                                        for q in task["checklist"]])
    return judge
