"""The trajectory format: the worked example in envace.py's docstring, number by number, and
the role bookkeeping of logged episodes and tool snippets."""
from types import SimpleNamespace

import pytest
import torch

import envace
from envace import ACT, OBS, PAD, PROMPT, REHEARSE, TAG, collate, encode_episode, loss_mask, tag_ids, token_advantages
from helpers import toy_tokenizer
from machinery import sharedprefix

P, A, R, O, T = PROMPT, ACT, REHEARSE, OBS, TAG
TOK = toy_tokenizer()


def test_the_docstring_example_number_by_number():
    e = encode_episode(TOK, "price apple", ["price apple"], ["3"], "3", env_role=REHEARSE)
    assert e["ids"] == [0, 7, 30, 3, 7, 30, 4, 5, 23, 6, 3, 14, 23, 4]
    assert e["roles"] == [P, P, P, T, A, A, A, T, R, R, T, A, A, A]
    ids, roles = collate([e], TOK.pad_token_id)
    assert ids[0, 1:].tolist() == [7, 30, 3, 7, 30, 4, 5, 23, 6, 3, 14, 23, 4]      # the targets
    assert loss_mask(roles)[0].int().tolist() == [0, 0, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1]
    adv = token_advantages(roles, torch.tensor([0.5]), act_coef=1.0, rehearse_coef=0.25)
    assert adv[0].tolist() == [0, 0, 0, .5, .5, .5, 0, .125, .125, 0, .5, .5, .5]


def test_real_world_responses_are_obs_and_snippet_calls_are_context():
    logged = encode_episode(TOK, "buy tea", ["price tea", "pay 4"], ["4", "5"], "5")
    assert logged["roles"][7:10] == [T, O, O]                # <env> forced, then "4 </env>" from the world
    snippet = encode_episode(TOK, "", ["pay 3"], ["6"], act_role=PROMPT)
    assert TOK.convert_ids_to_tokens(snippet["ids"]) == ["<bos>", "<act>", "pay", "3", "</act>", "<env>",
                                                          "6", "</env>"]
    assert snippet["roles"] == [P, T, P, P, P, T, O, O]      # only the response is ever trained
    assert loss_mask(collate([snippet], 1)[1], trained=(A, R, O))[0].int().tolist() == [0, 0, 0, 0, 0, 1, 1]


def test_padding_is_masked_by_role_not_by_id():
    tags = tag_ids(TOK)
    short = encode_episode(TOK, "price tea", [], [], "4")
    long = encode_episode(TOK, "price tea", ["price tea"], ["4"], "4")
    ids, roles = collate([short, long], pad_id=tags["act_end"])      # pad id == a trained token's id
    assert ids[0, len(short["ids"]):].eq(tags["act_end"]).all()
    assert roles[0, len(short["ids"]):].eq(PAD).all()
    mask = loss_mask(roles)
    assert mask[0, len(short["ids"]) - 1:].sum() == 0               # no loss on any pad
    assert mask[0, len(short["ids"]) - 2]                           # the real final </act> is trained


@pytest.mark.parametrize("token_logprobs", [envace.token_logprobs, sharedprefix.token_logprobs],
                         ids=["plain", "chunked_head"])
def test_logprobs_stay_fp32_under_cpu_bf16_autocast(token_logprobs):
    """cpu_bf16: the model runs in bf16, but token_logprobs casts its logits to fp32 before the
    log_softmax: the result is fp32 and equals the fp32 log_softmax of the bf16 logits, where a
    log_softmax taken in bf16 rounds each value to 8 bits of mantissa (errors of ~1e-2 at |logp| ~ 5).
    Both ways: envace's plain path and machinery.sharedprefix's chunked LM head, which train.py runs."""
    import torch.nn.functional as F
    from helpers import tiny_llama
    tok = toy_tokenizer()
    model = tiny_llama(tok, init_range=0.2).eval()
    ids = torch.randint(5, len(tok), (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logprobs = token_logprobs(model, ids)
        logits = model(input_ids=ids).logits
    assert logits.dtype == torch.bfloat16 and logprobs.dtype == torch.float32
    targets = ids[:, 1:, None]
    fp32 = F.log_softmax(logits[:, :-1].float(), -1).gather(-1, targets).squeeze(-1)
    in_bf16 = F.log_softmax(logits[:, :-1], -1).float().gather(-1, targets).squeeze(-1)
    assert torch.allclose(logprobs, fp32, atol=1e-6, rtol=0)
    assert (in_bf16 - fp32).abs().max() > 1e-3          # the check can tell the two apart


class PositionTable(torch.nn.Module):
    """A fake model whose logits at position t are log [.25, .25, .25] with .5 on id t % 3 (as
    transformers does, `logits_to_keep` keeps the last positions only)."""

    def forward(self, input_ids, use_cache=False, logits_to_keep=0):
        B, L = input_ids.shape
        probs = torch.full((B, L, 3), 0.25)
        probs[:, torch.arange(L), torch.arange(L) % 3] = 0.5
        return SimpleNamespace(logits=probs.log()[:, -logits_to_keep:])


def test_token_logprobs_by_hand():
    """Position t's logits give the logprob of the id at t+1: ids 0 0 2 0 -> targets 0 2 0 read at
    positions favouring 0, 1, 2 -> .5, .25, .25. At temperature 2 the logits halve: .5 and .25 become
    sqrt(.5) / (sqrt(.5) + 1) = 0.4142 and 0.5 / (sqrt(.5) + 1) = 0.2929. Entropy per position:
    -(.5 ln .5 + 2 x .25 ln .25) = 1.0397. start=2: positions before it are 0."""
    ids = torch.tensor([[0, 0, 2, 0]])
    logp, entropy = envace.token_logprobs(PositionTable(), ids, with_entropy=True)
    assert torch.allclose(logp.exp(), torch.tensor([[0.5, 0.25, 0.25]]))
    assert torch.allclose(entropy, torch.full((1, 3), 1.0397), atol=1e-4)
    hot = envace.token_logprobs(PositionTable(), ids, temperature=2.0)
    assert torch.allclose(hot.exp(), torch.tensor([[0.4142, 0.2929, 0.2929]]), atol=1e-4)
    cut = envace.token_logprobs(PositionTable(), ids, start=2)
    assert cut[0, :2].tolist() == [0.0, 0.0] and abs(cut[0, 2].exp().item() - 0.25) < 1e-6
