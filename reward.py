"""Task reward and group advantages (the paper's outcome reward, GRPO-style baseline).

Every episode gets ONE scalar, task success, and the same advantage goes on every ACT and every
REHEARSE token of that episode: a wrong rehearsal that leads to a wrong answer is punished
exactly like a wrong action. The official code groups rollouts by (task, role) with K = 4 and
uses A = R - mean(group), without dividing by the std; here a group is the G samples of one
task (inline rehearsal puts both roles in one row, so the two groupings coincide).

Worked example, two tasks x G = 3:

    group    0    0    0    1    1    1
    reward   1    0    0    1    1    1
    mean     1/3            1
    A        2/3 -1/3 -1/3  0    0    0      group 1 is all-equal: zero signal, counted

Chat-format tasks (chat.py) are scored by `chat_reward`: the final answer (normalised string or
number match), the tool calls against gold calls compared AST-style as BFCL does (type-aware
values, in order or in any order), and optionally the paper's checklist judge: a local causal LM
asked each yes/no question, scored by p(yes) / (p(yes) + p(no)) of its next token.

With rehearsal_context separate an episode is several rows (`training_rows`): its actor row and
one rehearse row per call, each with the episode's reward. `advantage_groups: task_role` (the
official grouping) gives the actor rows of a task one baseline and its rehearse rows another;
`task` gives them one shared mean. Task 0, G = 2: episode a (reward 1, two calls), b (0, one call):

    row       a.act  b.act  a.r1  a.r2  b.r1
    task_role  1/2   -1/2   1/3   1/3  -2/3     act mean 1/2, rehearse mean 2/3
    task       2/5   -3/5   2/5   2/5  -3/5     one mean over the 5 rows: 3/5

A mean is over rows, so an episode with more calls weighs more in its rehearse group. With
inline rehearsal every row holds both roles and one reward, so the two groupings are the same.
"""
from collections import Counter

import torch


def task_reward(episode, task):
    """1.0 when the episode ended with an answer equal to the task's answer, else 0.0.
    Malformed calls, malformed rehearsals and truncations end without an answer: 0."""
    return float(episode["cause"] == "answer" and episode["answer"] == task["answer"])


def group_advantages(rewards, group_ids, scale_std=False, eps=1e-6):
    """rewards [N] float, group_ids [N] int -> (advantages [N], number of all-equal groups)."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    group_ids = torch.as_tensor(group_ids)
    adv = torch.zeros_like(rewards)
    all_equal = 0
    for g in group_ids.unique():
        members = group_ids == g
        r = rewards[members]
        adv[members] = r - r.mean()
        if scale_std:
            adv[members] /= r.std(unbiased=False) + eps
        all_equal += int(bool((r == r[0]).all()))
    return adv, all_equal


def training_rows(episodes, rewards, task_ids, advantage_groups="task_role"):
    """(rows, row rewards, row group ids) for one update: each episode's own row, then its
    rehearse rows (episode["rehearsals"], separate context only), every row with its episode's
    reward. Groups: (task, role) for `task_role`, the task for `task` (see the module docstring)."""
    rows, row_rewards, groups = [], [], []
    for episode, reward, task in zip(episodes, rewards, task_ids):
        for row, role in [(episode, 0)] + [(r, 1) for r in episode.get("rehearsals", [])]:
            rows.append(row)
            row_rewards.append(reward)
            # task_role: group 2t holds task t's actor rows, 2t + 1 its rehearse rows (own baselines)
            groups.append(2 * task + role if advantage_groups == "task_role" else task)
    return rows, row_rewards, groups


def cause_counts(episodes):
    """How episodes ended: {'answer': n, 'bad_call': n, 'turn_limit': n, ...}."""
    return dict(Counter(e["cause"] for e in episodes))


# ----------------------------------------------------------------------------- chat-format rewards

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


def chat_reward(episode, task, judge=None):
    """Task success of a chat episode: 0 unless it ended with an answer; then 1 if every hard
    criterion the task gives holds (answer, gold_calls), times the mean judge p(yes) over the
    task's checklist when a judge is given (`judge(episode, task) -> [p(yes)]`)."""
    import json
    if episode["cause"] != "answer":
        return 0.0
    if "answer" in task and not answer_match(episode["answer"], task["answer"]):
        return 0.0
    calls = [json.loads(c) for c in episode["calls"]]
    if "gold_calls" in task and not calls_match(calls, task["gold_calls"], task.get("call_order", "exact")):
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
    from envace import encode
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
        lines = [f"call: {c}\nresult: {r}" for c, r in zip(episode["calls"], episode["responses"])]
        transcript = "\n".join(lines + [f"answer: {episode['answer']}"])
        return judge_yes_probability(model, tokenizer, [judge_prompt(tokenizer, task, transcript, q)
                                                        for q in task["checklist"]])
    return judge
