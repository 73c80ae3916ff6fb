"""The evaluation's fast paths give the plain paths' results exactly: the would-rehearse check
(honesty.greedy_hits with a stop: hits, and what greedy decoding writes where a response is
missed) on a tiny random Llama against a by-hand greedy decoding with full forwards, and against
the same model behind a wrapper of no transformers class (the plain path: whole logits, each
missed response decoded from a prefill of its prefix)."""
from collections import Counter

import torch

from envace import OBS, PROMPT, TAG
from helpers import POSITION_INIT, tiny_llama, toy_tokenizer
from worldmodel import honesty

TOK = toy_tokenizer()


class Plain(torch.nn.Module):
    """The model behind a wrapper that is no transformers model: greedy_hits' plain path."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, **kw):
        return self.model(**kw)


def full_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def greedy(model, ids, n, margins):
    """n ids greedy decoding writes after `ids`, each by a full forward over everything before it;
    each argmax's lead over the runner-up goes to `margins`."""
    out = []
    for _ in range(n):
        logits = full_logits(model, ids + out)[-1]
        top = logits.topk(2).values
        margins.append(float(top[0] - top[1]))
        out.append(int(logits.argmax()))
    return out


def episodes_and_expectations(model, stop, margins):
    """Rows of a shared 14-id prompt, 3 ids of their own, then 1-2 responses (OBS, after 2 TAG
    ids each) built from the model's own greedy continuation: copied up to the stop (a hit), or
    with one id changed (a miss: greedy decoding goes on from its first wrong id), or cut before
    a stop greedy decoding does not write there (a miss at the stop). Returns the rows, the
    expected hits per response and what greedy decoding writes for each missed one, computed by
    hand with full forwards (None: no stop within 2 x the response's length + 8 ids)."""
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(5, len(TOK), (14,), generator=g).tolist()
    rows, expected, kinds = [], {}, Counter()
    for k in range(16):
        ids = shared + torch.randint(5, len(TOK), (3,), generator=g).tolist()
        roles = [PROMPT] * len(ids)
        for turn in range(1 + k % 2):
            ids, roles = ids + [7, 8], roles + [TAG, TAG]
            cont = greedy(model, ids, 16, margins)
            at = cont.index(stop) if stop in cont else None
            change = int(torch.randint(0, 3, (1,), generator=g))
            if at is None:                              # no stop: a miss at its second id
                response, kind = cont[:1] + [(cont[1] + 1) % len(TOK) or 5, stop], "no stop"
            elif change == 0 or at < 2:
                response, kind = cont[:at + 1], "hit"
            elif change == 1:
                response, kind = cont[:1] + [(cont[1] + 1) % len(TOK) or 5] + cont[2:at + 1], "miss"
            else:
                response, kind = cont[:at - 1] + [stop], "miss at the stop"
            start = len(ids)
            ids, roles = ids + response, roles + [OBS] * len(response)
            if kind != "hit":
                written = response[:next(t for t in range(len(response)) if response[t] != cont[t])]
                written += greedy(model, ids[:start] + written, 2 * len(response) + 8 - len(written), margins)
                expected[(len(rows), start)] = written[:written.index(stop)] if stop in written else None
            kinds[kind] += 1
        rows.append({"ids": ids, "roles": roles})
    return rows, expected, kinds


def test_the_would_rehearse_check_decodes_misses_on_its_own_cache_as_the_plain_path_does():
    """greedy_hits with a stop, on a tiny random Llama at POSITION_INIT (a position or a cache row
    out of place moves its logits by ~1e-1): hits and the greedy writes of the missed responses
    (decoded from their first wrong id, on the teacher-forced pass's keys and values) equal a
    by-hand greedy decoding by full forwards, and the plain path's (whole logits, a prefill per
    missed response). Every argmax compared leads its runner-up by > 1e-3 (the paths differ by
    float rounding, ~1e-6 in a logit). The shared prompt runs once over three micro-batches and
    no missed response runs its prefix again: after the teacher-forced passes, every forward feeds
    one id a row. Covered: hits, misses that stop, misses at the stop, misses with no stop in
    bound, rows with two misses (a cache row copied twice).
    Mutations: the decoding rows' mask one column too long (they see the wrong id), the ids before
    the first miss left out of what is written, the first logits one position late, the shared
    prompt run in every micro-batch."""
    model = tiny_llama(TOK, seed=0, init_range=POSITION_INIT)
    stop = Counter(t for k in range(8) for t in greedy(model, [5 + k, 9, 11, 7, 8], 10, []) ).most_common(1)[0][0]
    margins = []
    rows, expected, kinds = episodes_and_expectations(model, stop, margins)
    assert min(margins) > 1e-3, min(margins)
    assert all(kinds[k] > 0 for k in ("hit", "miss", "miss at the stop", "no stop")), kinds
    written_rows = Counter(i for i, _ in expected)
    assert max(written_rows.values()) == 2 and None in expected.values() and any(
        v is not None for v in expected.values())
    want_hits = torch.zeros(len(rows), max(len(r["ids"]) for r in rows) - 1, dtype=torch.bool)
    for i, r in enumerate(rows):
        logits = full_logits(model, r["ids"])
        for t in range(1, len(r["ids"])):
            if r["roles"][t] == OBS:
                top = logits[t - 1].topk(2).values
                assert top[0] - top[1] > 1e-3
                want_hits[i, t - 1] = int(logits[t - 1].argmax()) == r["ids"][t]
    shapes = []
    model.model.embed_tokens.register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    budget = 3 * max(len(r["ids"]) for r in rows)          # micro-batches of about 3 rows
    hits, _, written = honesty.greedy_hits(model, rows, OBS, TOK.pad_token_id, budget, stop=stop)
    assert torch.equal(hits, want_hits) and written == expected
    passes = [s for s in shapes if s[1] > 1]
    assert passes[0] == (1, 14) and all(s[1] < max(len(r["ids"]) for r in rows) - 14 + 1 for s in passes[1:])
    assert len(passes) == 1 + len(set(map(tuple, honesty.micro_batches([len(r["ids"]) for r in rows], budget))))
    shapes.clear()
    plain_hits, _, plain_written = honesty.greedy_hits(Plain(model), rows, OBS, TOK.pad_token_id, budget, stop=stop)
    assert torch.equal(plain_hits, want_hits) and plain_written == expected
    assert any(s[1] > 14 for s in shapes[len(honesty.micro_batches([len(r["ids"]) for r in rows], budget)):])


class Scripted:
    """A stand-in for kvcache.Decoder: its logits pick script[k] at the k-th step, whatever it is fed."""

    def __init__(self, scripts, vocab=16):
        self.scripts, self.k, self.vocab = scripts, 0, vocab
        self.logits = self._logits()

    def _logits(self):
        return torch.nn.functional.one_hot(torch.tensor([s[min(self.k, len(s) - 1)] for s in self.scripts]),
                                           self.vocab).float()

    def step(self, runs):
        self.k += 1
        self.logits = self._logits()


def test_greedy_writes_stop_within_the_limit_by_hand():
    """Rows write 5 6 STOP, 5 5 5 5 ..., STOP, and from [3] already written 5 STOP. Limits 3, 3,
    1, 2: [5, 6] (stopped at its 3rd id, inside 3), None (3 ids, no stop), [] (the stop at once),
    None ([3, 5] reach 2 before the stop). Mutation: a limit of one id more (> for >=)."""
    STOP = 9
    decoder = Scripted([[5, 6, STOP], [5], [STOP], [5, STOP]])
    assert honesty.greedy_writes(decoder, [[], [], [], [3]], STOP, [3, 3, 1, 2]) == [[5, 6], None, [], None]
    assert decoder.k == 2                    # the last row ended at its 2nd id, so 2 steps were fed


def test_rows_that_start_alike_run_their_common_ids_once_and_keep_the_plain_hits():
    """greedy_hits over 8 rows: all start with the same 6 ids; rows 0-2 go on with the same 20
    more (separate rehearse rows of one tool: its instructions and schema), rows 3-5 with another
    18, rows 6-7 differ at once. Then ids of their own and a response (OBS), half of it each
    row's greedy choice (a hit), the rest not, then an answer that is not run. The 6 run once,
    the 20 and the 18 once each on top of them, each group's rows on its ids; the hits equal
    the plain forward's argmax (top-2 margins > 1e-3: no near-tie). Mutations: no group (each
    row runs the 20 or 18 itself), a group's ids run from the start again, the rows' positions
    counted from the group's start."""
    model = tiny_llama(TOK, seed=1, init_range=POSITION_INIT)
    g = torch.Generator().manual_seed(3)

    def some(n):
        return torch.randint(5, len(TOK), (n,), generator=g).tolist()
    start, tool_a, tool_b = some(6), some(20), some(18)
    heads = [start + tool_a] * 3 + [start + tool_b] * 3 + [start] * 2
    rows, margins = [], []
    for k, head in enumerate(heads):
        ids = head + some(3 + k % 3)
        response = greedy(model, ids, 4, margins)
        response[k % 4] = (response[k % 4] + 1) % len(TOK) or 5          # a miss at position k % 4
        rows.append({"ids": ids + response + some(3), "roles": [PROMPT] * len(ids) + [OBS] * 4 + [TAG] * 3})
    want = torch.zeros(len(rows), max(len(r["ids"]) for r in rows) - 1, dtype=torch.bool)
    for i, r in enumerate(rows):
        logits = full_logits(model, r["ids"])
        for t in range(len(r["ids"]) - 7, len(r["ids"]) - 3):               # the response's 4 ids
            top = logits[t - 1].topk(2).values
            assert top[0] - top[1] > 1e-3
            want[i, t - 1] = int(logits[t - 1].argmax()) == r["ids"][t]
    assert 0 < int(want.sum()) < 4 * len(rows)
    shapes = []
    model.model.embed_tokens.register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    hits, _, _ = honesty.greedy_hits(model, rows, OBS, TOK.pad_token_id)
    assert torch.equal(hits, want)
    assert sorted(s for s in shapes if s[0] == 1) == [(1, 6), (1, 18), (1, 20)]
    lengths = [len(r["ids"]) - 3 for r in rows]                             # up to the response's end
    assert sorted(s for s in shapes if s[0] > 1) == sorted(
        [(3, max(lengths[:3]) - 26), (3, max(lengths[3:6]) - 24), (2, max(lengths[6:]) - 6)])
