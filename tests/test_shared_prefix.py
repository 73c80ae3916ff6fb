"""The update's forward, two ways of saving work that must not change a number: the prefix every
row of a micro-batch shares runs once (machinery.sharedprefix.shared_prefix_forward), and the LM
head runs in chunks of positions under checkpoint (machinery.sharedprefix.head_logprobs). Each is
compared with the plain forward (envace.token_logprobs) on a tiny random Llama (RoPE, at
POSITION_INIT so that a position out of place moves the logprobs far past the tolerance):
logprobs, entropy and gradients; then the warm start and rl_step with share_prefix on and off;
and the model wrappings under which a prefix may be shared (machinery.distributed.can_share_prefix)."""
import contextlib
import copy

import pytest
import torch

import envace
import train
from envace import REHEARSE, encode_episode
from helpers import (GRAD_TOLERANCE, LOGPROB_TOLERANCE, POSITION_INIT, assert_same_gradients, recording, step_grads,
                     tiny_llama, toy_tokenizer)
from machinery import config, distributed, sharedprefix
from machinery.sharedprefix import shared_prefix_length, token_logprobs

TOK = toy_tokenizer()
PROMPT = "not pear buy 2 milk and egg"


class Plain(torch.nn.Module):
    """The model behind a wrapper that is no transformers model: token_logprobs takes its plain
    path (full logits, one log_softmax), the reference both savings are compared with."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **kw):
        return self.model(**kw)


def shared_rows():
    """Three episodes of one prompt, right-padded to different lengths. They share <bos>, the
    prompt, <act> and `price` (10 ids); the target at position 8 (<act> -> price) is ACT, trained
    inside the shared prefix."""
    eps = [encode_episode(TOK, PROMPT, ["price milk"], ["2"], "2", env_role=REHEARSE),
           encode_episode(TOK, PROMPT, ["price egg"], ["1"], "1", env_role=REHEARSE),
           encode_episode(TOK, PROMPT, ["price milk", "price egg"], ["2", "1"], "3", env_role=REHEARSE)]
    ids, roles = envace.collate(eps, TOK.pad_token_id)
    return ids, roles, [len(e["ids"]) for e in eps]


def forward_shapes(model):
    """The (batch, length) of every forward through the model's embedding, appended as they run."""
    shapes = []
    model.model.embed_tokens.register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    return shapes


def test_shared_prefix_length_by_hand():
    ids = torch.tensor([[1, 2, 3, 4, 0], [1, 2, 3, 5, 6]])
    assert shared_prefix_length(ids, [4, 5]) == 3
    # identical up to row 0's end, then its pad: only real tokens count, and each row keeps one after
    ids = torch.tensor([[1, 2, 3, 0, 0], [1, 2, 3, 0, 0]])
    assert shared_prefix_length(ids, [3, 3]) == 2
    assert shared_prefix_length(torch.tensor([[1, 2, 3, 4, 0], [1, 2, 3, 4, 5]]), [4, 5]) == 3   # row 0 is the prefix
    assert shared_prefix_length(torch.tensor([[1, 2, 3], [1, 2, 4]]), [3, 3]) == 2
    assert shared_prefix_length(torch.tensor([[1, 2, 3], [1, 4, 4]]), [3, 3]) == 0      # one id: not worth it
    assert shared_prefix_length(torch.tensor([[1, 2, 3], [1, 2, 4]]), [2, 3]) == 0      # 1 after the cap
    assert shared_prefix_length(torch.tensor([[1, 2, 3, 4]]), [4]) == 0                # one row
    ids, _, lengths = shared_rows()
    assert shared_prefix_length(ids, lengths) == 10


@pytest.mark.parametrize("start", [0, 8, 12])
def test_shared_prefix_logprobs_and_entropy_equal_the_plain_forward(start):
    """start 0: every target; 8: the first trained one, inside the shared prefix; 12: past it. The
    prefix runs once as one row, the suffixes as three; the result equals the plain forward's."""
    model = tiny_llama(TOK, init_range=POSITION_INIT)
    ids, _, lengths = shared_rows()
    prefix = shared_prefix_length(ids, lengths)
    with torch.no_grad():
        want, want_entropy = token_logprobs(Plain(model), ids, 0.7, with_entropy=True, start=start)
        shapes = forward_shapes(model)
        got, got_entropy = token_logprobs(model, ids, 0.7, with_entropy=True, start=start, prefix=prefix)
    assert shapes == [(1, prefix), (3, ids.shape[1] - prefix)]
    assert got.shape == want.shape == got_entropy.shape == (3, ids.shape[1] - 1)
    assert (got[:, :start] == 0).all() and (got_entropy[:, :start] == 0).all()
    assert (got - want).abs().max() < LOGPROB_TOLERANCE and (got_entropy - want_entropy).abs().max() < LOGPROB_TOLERANCE
    assert want[:, start:].abs().min() > 0.01              # (not a comparison of zeros)


def test_lean_logprobs_find_the_prefix_and_equal_the_plain_definition():
    """sharedprefix.lean_logprobs, envace.token_logprobs's signature (train.chosen_logprobs binds it
    under lean_logprobs): the same logprobs, entropy and gradients as envace's definition; with
    share_prefix it finds the shared ids itself (one forward of one row). Row 0 is 3 real ids and
    pads, row 1 holds the pad id as content right after the same 3 ids: the common prefix, 4, runs
    into row 0's pads (the cap is the suffix pass's one position, not row 0's length), and every
    position still gets its whole row's numbers."""
    model = tiny_llama(TOK, init_range=POSITION_INIT)
    pad = TOK.pad_token_id
    ids = torch.tensor([[2, 10, 11, pad, pad, pad], [2, 10, 11, pad, 12, 13]])
    assert shared_prefix_length(ids, [6, 6]) == 4 and shared_prefix_length(ids, [3, 6]) == 2   # by hand
    results = []
    for logprobs in (envace.token_logprobs, sharedprefix.lean_logprobs):
        model.zero_grad(set_to_none=True)
        shapes = forward_shapes(model)
        logp, entropy = logprobs(model, ids, 0.7, with_entropy=True, start=1)
        (logp.sum() + 0.1 * entropy.sum()).backward()
        results.append((logp.detach(), entropy.detach(), {n: q.grad.clone() for n, q in model.named_parameters()},
                        list(shapes)))
    (want, want_entropy, want_grads, plain_shapes), (got, got_entropy, grads, lean_shapes) = results
    assert plain_shapes == [(2, 6)] and lean_shapes == [(1, 4), (2, 2)]      # the prefix ran once, as one row
    assert (got - want).abs().max() < LOGPROB_TOLERANCE and (got_entropy - want_entropy).abs().max() < LOGPROB_TOLERANCE
    assert want[:, 1:].abs().min() > 0.01 and (got[:, :1] == 0).all()
    assert_same_gradients(want_grads, grads)


def test_batch_logprobs_start_at_the_first_trained_target_and_equal_the_plain_forward():
    """The no-grad logprob pass of rl_step (old and reference logprobs): with a loss mask it runs
    the LM head from the micro-batch's first trained target (8, inside the shared prefix), 0
    before it, and equals the plain forward from there. Mutation: the mask not read (start 0)."""
    model = tiny_llama(TOK, init_range=POSITION_INIT)
    ids, roles, lengths = shared_rows()
    mask = envace.loss_mask(roles)
    assert envace.first_target(mask) == 8
    got = sharedprefix.batch_logprobs(model, ids, lengths, mask, 1.0, micro_batch_tokens=1000, share_prefix=True)
    with torch.no_grad():
        want = token_logprobs(Plain(model), ids)
    assert (got[:, :8] == 0).all() and want[:, :8].abs().min() > 0.01
    assert (got[:, 8:] - want[:, 8:]).abs().max() < LOGPROB_TOLERANCE


def test_batch_logprobs_read_their_temperature_budget_and_share_prefix():
    """batch_logprobs' arguments, each once a config key, are each read: at temperature 0.7 the
    values are the plain forward's at 0.7 (1.0 moves them far past the tolerance); share_prefix
    true runs the 10 shared ids once, false every row whole; a budget of 30 tokens puts each row
    in a micro-batch of its own (longest first), each cut to its length, 0 past its end.
    Mutations: any of the three not passed on (the temperature 1.0, sharing always on, the
    default budget)."""
    model = tiny_llama(TOK, init_range=POSITION_INIT)
    ids, _, lengths = shared_rows()
    L = ids.shape[1]
    assert sorted(lengths) == [19, 19, L] and L == 26
    with torch.no_grad():
        want, at_one = envace.token_logprobs(model, ids, 0.7), envace.token_logprobs(model, ids, 1.0)
    assert (want - at_one).abs().max() > 100 * LOGPROB_TOLERANCE
    shapes = forward_shapes(model)
    for share, budget, forwards in ((True, 1000, [(1, 10), (3, L - 10)]), (False, 1000, [(3, L)]),
                                    (True, 30, [(1, L), (1, 19), (1, 19)])):
        shapes.clear()
        got = sharedprefix.batch_logprobs(model, ids, lengths, None, 0.7, budget, share_prefix=share)
        assert shapes == forwards
        for i, n in enumerate(lengths):
            assert (got[i, :n - 1] - want[i, :n - 1]).abs().max() < LOGPROB_TOLERANCE
            assert (got[i, n - 1:] == 0).all() or budget == 1000      # (rows together: past a row's end, its pads)


def test_shared_prefix_gradients_equal_the_plain_forward():
    """A loss of the trained targets' logprobs (one inside the prefix) and the entropy: the first
    step's gradient, through the cached keys and values into the prefix pass, is the plain one's."""
    model = tiny_llama(TOK, init_range=POSITION_INIT)
    ids, roles, lengths = shared_rows()
    mask = envace.loss_mask(roles).float()
    assert mask[:, 8].all()                                 # a trained target inside the prefix
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    grads = []
    for m, prefix in ((Plain(model), 0), (model, shared_prefix_length(ids, lengths))):
        model.zero_grad(set_to_none=True)
        logp, entropy = token_logprobs(m, ids, 0.7, with_entropy=True, start=8, prefix=prefix)
        ((logp * weights).sum() + 0.1 * (entropy * mask).sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert_same_gradients(*grads)


def test_shared_prefix_under_gradient_checkpointing_gives_the_plain_gradients():
    """With every decoder layer checkpointed (recomputed in backward), the prefix still runs once
    and its cache is read by the recompute as by the forward: the gradients equal the plain
    forward's without checkpointing. Without keep_cache_when_checkpointing, transformers would
    drop the cache in a checkpointed layer, so sharing is refused there (the plain path runs)."""
    model = tiny_llama(TOK, init_range=POSITION_INIT)
    ids, roles, lengths = shared_rows()
    prefix = shared_prefix_length(ids, lengths)
    mask = envace.loss_mask(roles).float()
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    model.train()

    def gradients(m, prefix):
        model.zero_grad(set_to_none=True)
        logp = token_logprobs(m, ids, 0.7, start=8, prefix=prefix)
        (logp * weights).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}
    want = gradients(Plain(model), 0)
    model.activation_checkpointing_enable()
    assert not distributed.can_share_prefix(model)
    distributed.keep_cache_when_checkpointing(model)
    assert distributed.can_share_prefix(model)
    calls = []
    for layer in model.model.layers:
        inner = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda *a, f=inner, **k: calls.append(1) or f(*a, **k)
    shapes = forward_shapes(model)
    got = gradients(model, prefix)
    assert shapes == [(1, prefix), (3, ids.shape[1] - prefix)]
    assert len(calls) == 2 * len(model.model.layers)          # both passes checkpointed, every layer
    assert_same_gradients(want, got)


def saved_logit_tensors(fn, vocab):
    """fn() run with autograd's saved tensors watched: the shapes of the [B, T, vocab] tensors kept
    for backward (checkpoint keeps its own inside; only what outlives a chunk is seen here)."""
    shapes = []

    def pack(t):
        if t.dim() == 3 and t.shape[-1] == vocab:
            shapes.append(tuple(t.shape))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return shapes, out


def test_chunked_head_equals_the_full_logits(monkeypatch):
    """LOGIT_CHUNK of 3 positions' logits: values and gradients equal the plain path's (the chunks
    only regroup positions: each logprob is the same sum of products over the hidden width, so they
    agree within float32 rounding, LOGPROB_TOLERANCE and GRAD_TOLERANCE); the plain path keeps its
    [B, T, V] log-softmax for backward, the chunked one no tensor of the vocabulary's width."""
    model = tiny_llama(TOK, init_range=POSITION_INIT)
    ids, roles, _ = shared_rows()
    vocab = model.config.vocab_size
    monkeypatch.setattr(sharedprefix, "LOGIT_CHUNK", 3 * ids.shape[0] * vocab)     # 3 positions of the 3 rows
    chunks, checkpoint = [], sharedprefix.checkpoint
    monkeypatch.setattr(sharedprefix, "checkpoint", lambda fn, h, *a, **k: chunks.append(h.shape[1]) or checkpoint(fn, h, *a, **k))
    weights = torch.randn(ids.shape[0], ids.shape[1] - 1, generator=torch.Generator().manual_seed(1))
    results = []
    for m in (Plain(model), model):
        model.zero_grad(set_to_none=True)
        saved, (logp, entropy) = saved_logit_tensors(lambda: token_logprobs(m, ids, 0.7, with_entropy=True), vocab)
        ((logp * weights).sum() + entropy.sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((saved, logp.detach(), entropy.detach(), grads))
    (plain_saved, want, want_entropy, want_grads), (saved, got, got_entropy, grads) = results
    assert chunks == [3] * ((ids.shape[1] - 1) // 3) + [(ids.shape[1] - 1) % 3] * bool((ids.shape[1] - 1) % 3)
    assert (got - want).abs().max() < LOGPROB_TOLERANCE and (got_entropy - want_entropy).abs().max() < LOGPROB_TOLERANCE
    assert_same_gradients(want_grads, grads)
    assert (3, ids.shape[1] - 1, vocab) in plain_saved and saved == []


def warm_start_grads(model, cfg, sequences, monkeypatch):
    """The first warm-start step's gradient (taken where it is clipped, before AdamW's step)."""
    seen = []
    clip = torch.nn.utils.clip_grad_norm_

    def record(params, max_norm):
        params = list(params)
        seen.append({n: p.grad.clone() for n, p in model.named_parameters()})
        return clip(params, max_norm)
    with pytest.MonkeyPatch.context() as patch:       # undoes this patch alone, not the test's
        patch.setattr(torch.nn.utils, "clip_grad_norm_", record)
        train.warm_start(model, model, sequences, cfg, TOK.pad_token_id, logprobs=train.chosen_logprobs(cfg))
    return seen[0]


def test_warm_start_and_rl_step_give_the_same_gradients_with_and_without_sharing(monkeypatch):
    """One warm-start step and one rl_step (old logprobs recomputed, a KL reference: every logprob
    pass of the step) with share_prefix true and false: the same first-step gradients, and sharing
    did run (a forward of one row)."""
    import world
    model = tiny_llama(TOK, init_range=POSITION_INIT)
    calls = [["price milk"], ["price egg"], ["price milk", "price egg"], ["price tea"]]
    logged = [encode_episode(TOK, PROMPT, c, world.replay(c), "9") for c in calls]
    episodes = [encode_episode(TOK, PROMPT, c, world.replay(c), "9", env_role=REHEARSE) for c in calls]
    base = {**config.DEFAULTS, "sft_steps": 1, "sft_batch_size": 4, "micro_batch_tokens": 1000, "kl_coef": 0.1,
            "reuse_sampler_logprobs": False}
    reference = copy.deepcopy(model)
    shapes = forward_shapes(model)
    grads = {}
    for share in (False, True):
        cfg = {**base, "share_prefix": share}
        start = copy.deepcopy(model.state_dict())
        warm = warm_start_grads(model, cfg, logged, monkeypatch)     # lean_logprobs, as setup chooses it
        model.load_state_dict(start)
        opt = recording(torch.optim.SGD)(model.parameters(), lr=0.0)
        batch = train.make_batch(episodes, [1.0, 0.0, 0.0, 1.0], {**cfg, "group_size": 4}, TOK.pad_token_id)
        stats = train.rl_step(model, model, opt, batch, cfg, contextlib.nullcontext(), train.chosen_logprobs(cfg),
                              reference=reference)
        assert stats["status"] == "updated"
        grads[share] = warm, step_grads(model, opt)
        assert any(b == 1 for b, _ in shapes) == share
    assert_same_gradients(grads[False][0], grads[True][0])
    assert_same_gradients(grads[False][1], grads[True][1])


def test_identical_rows_share_all_but_their_last_id_and_equal_the_plain_forward(monkeypatch):
    """A micro-batch whose rows are one episode three times (a group whose samples wrote the same,
    a warm-start batch drawing one trajectory twice): the common prefix is the whole row, so it is
    cut one id short (shared_prefix_length) and the suffix pass is one position, whose target lies
    past the row's end. Logprobs and entropy (every target, and the last alone), the gradients,
    and one warm-start step and one rl_step (a KL reference that is not the model, so that the
    gradient does not cancel between rows of opposite advantage) equal the plain forward's; the
    LM head runs on the prefix's one row, in chunks of LOGIT_CHUNK / vocabulary positions.
    Mutations: the prefix the whole row (no suffix left), an empty piece sent to the LM head, the
    chunk sized by the batch's rows instead of the hidden states' (B times shorter here)."""
    model = tiny_llama(TOK, init_range=POSITION_INIT)
    episode = encode_episode(TOK, PROMPT, ["price milk"], ["2"], "2", env_role=REHEARSE)
    ids, roles = envace.collate([episode] * 3, TOK.pad_token_id)
    L = ids.shape[1]
    prefix = shared_prefix_length(ids, [L] * 3)
    assert prefix == L - 1
    # the LM head's budget 9 positions of one row: the prefix's one row of hidden states goes 9 at a time
    monkeypatch.setattr(sharedprefix, "LOGIT_CHUNK", 9 * model.config.vocab_size)
    chunks, checkpoint = [], sharedprefix.checkpoint
    monkeypatch.setattr(sharedprefix, "checkpoint",
                        lambda fn, h, *a, **k: chunks.append(h.shape) or checkpoint(fn, h, *a, **k))
    for start, pieces in ((0, [(1, 9), (1, 9)]), (L - 2, [(1, 1)])):
        chunks.clear()
        with torch.no_grad():
            want, want_entropy = token_logprobs(Plain(model), ids, 0.7, with_entropy=True, start=start)
            shapes = forward_shapes(model)
            got, got_entropy = token_logprobs(model, ids, 0.7, with_entropy=True, start=start, prefix=prefix)
        assert shapes == [(1, L - 1), (3, 1)] and [tuple(c[:2]) for c in chunks] == pieces
        assert (got - want).abs().max() < LOGPROB_TOLERANCE and (got_entropy - want_entropy).abs().max() < LOGPROB_TOLERANCE
        assert want[:, start:].abs().min() > 0.01 and (got[:, :start] == 0).all()
    mask = envace.loss_mask(roles).float()
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    grads = []
    for m, p in ((Plain(model), 0), (model, prefix)):
        model.zero_grad(set_to_none=True)
        logp, entropy = token_logprobs(m, ids, 0.7, with_entropy=True, start=8, prefix=p)
        ((logp * weights).sum() + 0.1 * (entropy * mask).sum()).backward()
        grads.append({n: q.grad.clone() for n, q in model.named_parameters()})
    assert_same_gradients(*grads)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for q in reference.parameters():
            q.mul_(0.9)
    base = {**config.DEFAULTS, "sft_steps": 1, "sft_batch_size": 3, "micro_batch_tokens": 1000, "kl_coef": 0.1,
            "reuse_sampler_logprobs": False}
    shapes = forward_shapes(model)
    steps = {}
    for share in (False, True):
        cfg = {**base, "share_prefix": share}
        start = copy.deepcopy(model.state_dict())
        warm = warm_start_grads(model, cfg, [episode] * 3, monkeypatch)     # lean_logprobs, as setup chooses it
        model.load_state_dict(start)
        opt = recording(torch.optim.SGD)(model.parameters(), lr=0.0)
        batch = train.make_batch([episode] * 4, [1.0, 0.0, 1.0, 0.0], {**cfg, "group_size": 2}, TOK.pad_token_id)
        stats = train.rl_step(model, model, opt, batch, cfg, contextlib.nullcontext(), train.chosen_logprobs(cfg),
                              reference=reference)
        assert stats["status"] == "updated"
        steps[share] = warm, step_grads(model, opt)
        assert ((1, L - 1) in shapes) == share
    assert_same_gradients(steps[False][0], steps[True][0])
    assert_same_gradients(steps[False][1], steps[True][1])


def test_greedy_hits_run_the_head_on_the_responses_only_and_equal_the_plain_argmax():
    """honesty.greedy_hits on a transformers model: the 10 shared ids run once, then each row up to
    its last response (the answer after it is not run), the LM head on the OBS targets only (and on the one position each forward keeps), and the hits equal the
    plain forward's argmax there, False at every other target. The responses are made the model's
    own greedy choices (so that hits are True), then row 2's last is made wrong (a False). Where
    an argmax is compared its top-2 margin is asserted > 1e-3: the two computations differ by
    float rounding (~1e-6 in a logit), so no comparison is a near-tie. Mutations: the suffix one
    position off, the head on every position, the role mask dropped (hits at ACT targets)."""
    from worldmodel import honesty
    model = tiny_llama(TOK, seed=0, init_range=POSITION_INIT).eval()
    eps = [encode_episode(TOK, PROMPT, ["price milk"], ["2"], "2"),
           encode_episode(TOK, PROMPT, ["price egg"], ["1"], "1"),
           encode_episode(TOK, PROMPT, ["price milk", "price egg"], ["2", "1"], "3")]
    with torch.no_grad():
        for e in eps:                          # each OBS id: the plain model's greedy choice
            for t in range(1, len(e["ids"])):
                if e["roles"][t] == envace.OBS:
                    e["ids"][t] = int(Plain(model)(input_ids=torch.tensor([e["ids"][:t]])).logits[0, -1].argmax())
        wrong = max(t for t, r in enumerate(eps[2]["roles"]) if r == envace.OBS)     # no OBS id after it
        eps[2]["ids"][wrong] = (eps[2]["ids"][wrong] + 1) % len(TOK)
        ids, roles = envace.collate(eps, TOK.pad_token_id)
        logits = Plain(model)(input_ids=ids).logits[:, :-1]
    obs = roles[:, 1:] == envace.OBS
    top2 = logits.topk(2, dim=-1).values
    assert ((top2[..., 0] - top2[..., 1])[obs] > 1e-3).all()
    expected = (logits.argmax(-1) == ids[:, 1:]) & obs
    assert expected.sum() == obs.sum() - 1 and not expected[2, wrong - 1]
    heads, shapes = [], forward_shapes(model)
    model.lm_head.register_forward_hook(lambda m, args, out: heads.append(args[0].shape[:-1].numel()))
    hits, got_roles, _ = honesty.greedy_hits(model, eps, envace.OBS, TOK.pad_token_id)
    assert torch.equal(got_roles, roles) and torch.equal(hits, expected)
    last = max(max(t for t, r in enumerate(e["roles"]) if r == envace.OBS) for e in eps)
    assert last + 1 < ids.shape[1]                          # the rows go on after their last response
    assert shapes == [(1, 10), (3, last + 1 - 10)]          # the shared ids once, then the suffixes up to it
    assert sum(heads) == int(obs.sum()) + 1 + 3             # + the one kept position of each forward
    # the same model behind a wrapper of no transformers class: its logits whole, the same hits
    assert torch.equal(honesty.greedy_hits(Plain(model), eps, envace.OBS, TOK.pad_token_id)[0], expected)
