"""Multi-turn chat dialogues: tasks whose user speaks again after the answer (`turns`, `format: chat`).

The answer -> next user turn hand-off is derived from the chat template as chat.chat_format
derives the others (`turn_handoff`: sentinel contents, the text around them cut out) and checked
at start (`check_turn_assembly`: the sampler's assembly of a two-turn conversation equals the
template's rendering). Each later turn's forced ids (glue TAG, user content PROMPT) are tokenized
once per task (`turn_ids`), and the task's world hands them to the sampler after each answer
(chat.task_world's `next_turn`). Logged trajectories may hold several user turns: their rows
are built turn by turn (`assemble_dialogue`); the task file's `turns` and per-turn `gold_calls`
are read in chat/tasks.py.

Simplified: the later user turns are fixed in the task file (no simulated user); the hand-off
must be the same after every answer; rehearsal_context separate and private rehearsal
(rehearsal_budget > 0) do not support multi-turn tasks (format_chat.setup refuses them).
"""
from chat import templates
from chat.format import SAMPLE_OPENING, SAMPLE_TOOL, SAMPLE_TURNS, _tok, assemble, first_difference, prompt_ids
from envace import ACT, OBS, PROMPT, TAG, encode
from chat.templates import TemplateError, render


SAMPLE_ANSWERS = ["An apple is a fruit.", "I could not find it."]
SAMPLE_NEXT_TURN = [{"role": "user", "content": "And what is a pear?"}]


def turn_handoff(tokenizer, template=None):
    """The hand-off answer -> next user turn, derived from the template with sentinel contents as
    chat_format derives the others. In `opening, answer A1, user U2` and in `..., A1, U2, answer
    A2, user U3, user U4` (a turn of two user messages), each rendered with the generation prompt,
    the text after an answer's content is: the text before the actor's stop and the stop (written
    by the actor), `turn_pre` up to the first user content, the contents separated by `turn_sep`,
    then `turn_post` up to the end of the generation prompt. turn_pre and turn_post must be the
    same after answer 1 and answer 2. Returns them as text, with the stop (turn_stop) and the text
    before it (turn_stop_pre); `turn_ids` tokenizes them with each task's user contents."""
    s = [templates.SENTINEL.format(k) for k in ("S", "U", "A1", "U2", "A2", "U3", "U4")]
    opening = [{"role": "system", "content": s[0]}, {"role": "user", "content": s[1]}]
    later = [{"role": r, "content": c} for r, c in zip(("assistant", "user", "assistant", "user", "user"), s[2:])]
    one = templates._cut(render(tokenizer, opening + later[:2], [SAMPLE_TOOL], True, template), s[2], s[3],
                         "hand-off answer->user")
    two = templates._cut(render(tokenizer, opening + later, [SAMPLE_TOOL], True, template), s[4], "",
                         "hand-off answer->user")
    stop_pre, stop_text, turn_pre = templates._first_special(tokenizer, one, "hand-off answer->user")
    stop = {str(t): i for i, t in tokenizer.added_tokens_decoder.items()}[stop_text]
    turn_post = templates._cut(render(tokenizer, opening + later[:2], [SAMPLE_TOOL], True, template), s[3], "",
                               "hand-off answer->user")
    head = stop_pre + stop_text + turn_pre + s[5]
    if not (two.startswith(head) and two.endswith(s[6] + turn_post) and len(two) >= len(head + s[6] + turn_post)):
        raise TemplateError(f"hand-off answer->user depends on the turn: {one + s[3] + turn_post!r} after answer 1, "
                            f"{two!r} after answer 2")
    return {"turn_pre": turn_pre, "turn_sep": two[len(head):len(two) - len(s[6] + turn_post)], "turn_post": turn_post,
            "turn_stop": stop, "turn_stop_pre": stop_pre}


def turn_tags(tokenizer, tags):
    """`tags` with the answer -> next user turn hand-off (turn_handoff), checked: the answer before
    a user turn ends with the actor's own end-of-turn stop (act_pre, act_end), and the sampler's
    assembly of a two-turn conversation equals the template's rendering (check_turn_assembly)."""
    handoff = turn_handoff(tokenizer, tags.get("template"))
    if (handoff["turn_stop_pre"], handoff["turn_stop"]) != (tags["act_pre"], tags["act_end"]):
        raise TemplateError(f"hand-off answer->user: an answer before a user turn ends with "
                            f"{handoff['turn_stop_pre']!r} + {_tok(tokenizer, handoff['turn_stop'])}, not with the "
                            f"actor's stop {tags['act_pre']!r} + {_tok(tokenizer, tags['act_end'])}")
    tags = {**tags, **handoff}
    check_turn_assembly(tokenizer, tags)
    return tags


def turn_ids(tokenizer, tags, messages):
    """A later user turn (its user messages) as the forced (id, role) pairs the sampler appends
    after the actor's answer and stop: the hand-off and the contents tokenized as ONE text, as the
    template renders them (it follows a special token, so the text tokenizes as in the whole
    conversation); tokens inside a content are PROMPT, the template's glue TAG. Computed once per
    task (episode_inputs); what the policy sampled is never re-tokenized."""
    text, spans = tags["turn_pre"], []
    for k, m in enumerate(messages):
        text += tags["turn_sep"] if k else ""
        spans.append((len(text), len(text) + len(m["content"])))
        text += m["content"]
    text += tags["turn_post"]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [(i, PROMPT if any(a < end and start < b for start, end in spans) else TAG)
            for i, (a, b) in zip(enc["input_ids"], enc["offset_mapping"])]


def assemble_dialogue(tokenizer, tags, prompt, turns, calls, responses, call_turns, answers, env_role=OBS,
                      act_role=ACT):
    """A multi-turn episode built the sampler's way (`assemble` per user turn): turn 0 from the
    prompt; each later turn reached (`turns`: its forced (id, role) pairs, turn_ids) after the
    answer of the one before, then its calls (those whose call_turns entry is its index), responses
    and answer (answers[k], or none yet). With no later turn it is `assemble`."""
    out = {"ids": [], "roles": [], "where": []}
    for k in range(1 + len(turns)):
        if k:
            out["ids"] += [i for i, _ in turns[k - 1]]
            out["roles"] += [r for _, r in turns[k - 1]]
            out["where"] += [f"user turn {k + 1}"] * len(turns[k - 1])
        mine = [j for j, n in enumerate(call_turns) if n == k]
        part = assemble(tokenizer, tags if k == 0 else {**tags, "first_act": []}, prompt if k == 0 else [],
                        [calls[j] for j in mine], [responses[j] for j in mine if j < len(responses)],
                        answers[k] if k < len(answers) else None, env_role, act_role)
        out["ids"] += part["ids"]
        out["roles"] += part["roles"]
        out["where"] += [f"turn {k + 1}: {w}" for w in part["where"]] if turns else part["where"]
    return out


def check_turn_assembly(tokenizer, tags):
    """check_assembly for two user turns: a call, its response, an answer, the next user message,
    a call, its response, an answer. At every point where the actor is handed the turn (after the
    prompt, after each response, after the next user turn), the sampler's assembly (forced turn
    ids from turn_ids) must equal the template's own rendering with its generation prompt."""
    calls, responses = [c for c, _ in SAMPLE_TURNS], [r for _, r in SAMPLE_TURNS]
    tool_turn = [[{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": c}]},
                  {"role": "tool", "content": r}] for c, r in SAMPLE_TURNS]
    answer = [{"role": "assistant", "content": a} for a in SAMPLE_ANSWERS]
    prompt = prompt_ids(tokenizer, SAMPLE_OPENING, [SAMPLE_TOOL], tags.get("template"))
    forced = [turn_ids(tokenizer, tags, SAMPLE_NEXT_TURN)]
    # (history, later turns reached, calls made, answers given) at each hand-back
    points = [(tool_turn[0], 0, 1, 0), (tool_turn[0] + answer[:1] + SAMPLE_NEXT_TURN, 1, 1, 1),
              (tool_turn[0] + answer[:1] + SAMPLE_NEXT_TURN + tool_turn[1], 1, 2, 1)]
    for history, reached, n_calls, n_answers in points:
        want = encode(tokenizer, render(tokenizer, SAMPLE_OPENING + history, [SAMPLE_TOOL], True, tags.get("template")))
        got = assemble_dialogue(tokenizer, tags, prompt, forced[:reached], calls[:n_calls], responses[:n_calls],
                                [0, 1][:n_calls], SAMPLE_ANSWERS[:n_answers])
        first_difference(tokenizer, got, want, "the sampler's multi-turn dialogues")


def multiturn(tasks):
    """Whether any task (or logged trajectory) has later user turns."""
    return any(t.get("turns") for t in tasks)
