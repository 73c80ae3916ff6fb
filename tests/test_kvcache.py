"""The sampler's two batch decoders (machinery/kvcache.py): the plain one the demo samples with and
the one with the speed tricks of long prompts sample the same episodes, and `decoder` gives each
the prefixes it is meant for."""
import pytest
import torch

import world
from envace import collate, encode, tag_ids
from helpers import POSITION_INIT, Bigram, tiny_llama, toy_tokenizer
from machinery import kvcache
from machinery.config import DEFAULTS
from rollout import sample_episodes

TOK = toy_tokenizer()
PAIRS = {"<act>": "price", "price": "apple", "apple": "</act>", "<env>": "3", "3": "</env>"}


@pytest.mark.parametrize("env_mode", ["rehearse", "real"])
@pytest.mark.parametrize("calls", [False, True])
def test_the_plain_and_the_fast_decoder_sample_the_same_episodes(env_mode, calls, monkeypatch):
    """sample_episodes with every prefix sent to PlainDecoder (PLAIN_BELOW above any prefix) and
    to Decoder (PLAIN_BELOW 0): 3 prompts x 4 rows (Decoder prefills each prompt once and copies
    its rows; PlainDecoder prefills all 12), rows finishing at different steps (dropped from the
    cache), forced runs of several ids in real mode; a tiny Llama as the demo's (a transformers
    model: the LM head on the last position only), and with a bonus on calls and responses
    (Bigram: episodes that call and rehearse). Same seed: the same ids in every episode, and
    every logprob within the two decoders' fp32 roundoff of each other.
    Tolerance: the two compute each logit from the same products summed in another order (other
    batch shapes, a concatenated cache against views of a larger buffer), an error of at most one
    unit roundoff u = 2^-24 per accumulated term, n = layers x (hidden + longest row) terms of size
    up to max|logit|: d = n u max(1, max|logit|); a logprob (a logit minus the logsumexp of the
    logits, at temperature 1) moves by at most 2 d. Measured: 0 (the same bits) on 1 thread. A
    different token sampled would fail on the ids, a row read at a wrong position or another
    row's cache would move logprobs by ~1e-1 (POSITION_INIT)."""
    model = tiny_llama(TOK, seed=1, init_range=POSITION_INIT)
    if calls:
        model = Bigram(model, TOK, PAIRS, bonus=8.0)
    prompts = [p for p in ("cost 3 fish", "not pear buy 2 milk and egg", "buy tea") for _ in range(4)]
    made, eps, factory = [], {}, kvcache.decoder

    def spy(*args):
        made.append(factory(*args))
        return made[-1]
    monkeypatch.setattr(kvcache, "decoder", spy)
    for name, below in (("plain", 10 ** 9), ("fast", 0)):
        monkeypatch.setattr(kvcache, "PLAIN_BELOW", below)
        eps[name] = sample_episodes(model, TOK, prompts, env_mode, settings={"max_tokens": 48},
                                    generator=torch.Generator().manual_seed(3))
    assert [type(d) for d in made] == [kvcache.PlainDecoder, kvcache.Decoder]
    assert [e["ids"] for e in eps["plain"]] == [e["ids"] for e in eps["fast"]]
    assert len({len(e["ids"]) for e in eps["plain"]}) > 2                 # rows left at different steps
    if calls:
        assert sum(len(e["calls"]) for e in eps["plain"]) >= len(prompts)
    ids, _ = collate(eps["plain"], TOK.pad_token_id)
    with torch.no_grad():
        biggest = model(input_ids=ids).logits.abs().max().item()
    n_terms = model.config.num_hidden_layers * (model.config.hidden_size + ids.shape[1])
    tol = 2 * n_terms * 2 ** -24 * max(1.0, biggest)
    worst = max(abs(a - b) for p, f in zip(eps["plain"], eps["fast"]) for a, b in zip(p["logprobs"], f["logprobs"]))
    assert worst <= tol, (worst, tol)


def test_decoder_picks_the_plain_one_for_the_demos_prompts_only():
    """`decoder` gives PlainDecoder prefixes shorter than PLAIN_BELOW ids (16) and Decoder anything
    longer (one prefix of 16 ids among short ones is enough) and rows restored from a saved cache;
    every prompt of the demo's tasks (small.yaml's splits: logged, RL, test), with its <bos>, is
    shorter, so the demo samples on the plain decoder. A row saved by PlainDecoder and restored in
    a Decoder gives the same logits after the same next ids."""
    model = tiny_llama(TOK, seed=2, init_range=POSITION_INIT)
    pad = TOK.pad_token_id
    short, long = list(range(5, 5 + 15)), list(range(5, 5 + 16))
    assert kvcache.PLAIN_BELOW == 16
    assert type(kvcache.decoder(model, [short, [5, 6]], pad)) is kvcache.PlainDecoder
    assert type(kvcache.decoder(model, [long, [5, 6]], pad)) is kvcache.Decoder
    splits = world.make_splits(DEFAULTS["data_seed"], DEFAULTS["n_logged"], 48, DEFAULTS["n_rl_tasks"],
                               DEFAULTS["n_test"])
    bos = tag_ids(TOK)["bos"]
    longest = max(len(bos + encode(TOK, t["prompt"])) for split in ("logged", "rl", "test") for t in splits[split])
    assert longest < kvcache.PLAIN_BELOW, longest
    plain = kvcache.decoder(model, [[5, 6, 7], [8, 9]], pad)
    saved = [plain.save(1), plain.save(0)]
    restored = kvcache.decoder(model, [[8, 9], [5, 6, 7]], pad, saved)
    assert type(restored) is kvcache.Decoder
    after = restored.step([[10, 11], [12]])
    with torch.no_grad():
        for j, row in enumerate([[8, 9, 10, 11], [5, 6, 7, 12]]):
            full = model(input_ids=torch.tensor([row])).logits[0, -1]
            assert torch.allclose(after[j], full, atol=1e-5), j       # fp32, other sum orders: ~1e-7
