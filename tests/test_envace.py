"""The trajectory format: the worked example in envace.py's docstring, number by number, and
the role bookkeeping of logged episodes and tool snippets."""
import torch

from envace import ACT, OBS, PAD, PROMPT, REHEARSE, TAG, collate, encode_episode, loss_mask, tag_ids, token_advantages
from helpers import toy_tokenizer

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
