"""The trajectory format: one episode = one token sequence, one role per token.

This is the data structure of the paper's world rehearsal (Sec. 3): a single policy writes both
its actions and the environment's responses into one context. Every token carries a role:

    PROMPT    the task (and any context the policy did not write)      no loss
    ACT       a token the policy sampled as the actor (its call/answer)  loss
    REHEARSE  a token the policy sampled as the environment             loss (EnvACE's novelty)
    OBS       a token a real environment or a frozen simulator wrote     no loss in RL
    TAG       a role hand-off forced by the sampler as ids (<act>, <env>) no loss
              (chat format: the template's glue, e.g. <|im_start|>assistant\n)
    PAD       padding                                                   no loss

With `rehearsal_context: separate` a rehearsal is a row of its own (its response REHEARSE there),
and its copy in the actor's row is OBS: context the actor reads, with no loss in that row.

`input_ids` and `roles` are built side by side while sampling (rollout.py) and never re-derived
by decoding and re-encoding text. The loss mask derives from roles and is shifted by one, since
the logits at position t predict the token at t+1.

Worked example: the task `price apple` in rehearse mode, with the toy tokenizer's real ids
(tests/test_envace.py checks every number below):

    token   <bos> price apple <act> price apple </act> <env>  3   </env> <act> answer 3  </act>
    id        0    7     30     3    7     30     4     5    23     6     3     14   23    4
    role      P    P     P      T    A     A      A     T    R      R     T     A    A     A
    t         0    1     2      3    4     5      6     7    8      9     10    11   12    13

    loss_mask (predict t+1 from t; length 13):
      t:        0  1  2  3  4  5  6  7  8  9  10 11 12
      target:   7  30 3  7  30 4  5  23 6  3  14 23 4
      mask:     0  0  0  1  1  1  0  1  1  0  1  1  1

The first ACT token `price` (t=4) is predicted from the forced tag at t=3, so mask[3] = 1; the
forced `<env>` at t=7 is predicted at t=6 and gets no loss (mask[6] = 0); the rehearsed `3` and
`</env>` get loss (mask[7], mask[8]). In `real` mode those two tokens are OBS and mask[7] =
mask[8] = 0. The same episode's advantage A sits on every position whose mask is 1, times
`act_coef` for ACT targets and `rehearse_coef` for REHEARSE targets.
"""
import os
import shutil

import torch
import torch.nn.functional as F

PROMPT, ACT, REHEARSE, OBS, TAG, PAD = range(6)
ROLE_NAMES = ["prompt", "act", "rehearse", "obs", "tag", "pad"]
TAGS = {"bos": "<bos>", "pad": "<pad>", "unk": "<unk>", "act": "<act>", "act_end": "</act>",
        "env": "<env>", "env_end": "</env>"}


# ----------------------------------------------------------------------------- tokenizer / model

def build_tokenizer(words):
    """A word-level tokenizer (digits split one per token) wrapped as a transformers tokenizer, so
    that save_pretrained / from_pretrained work exactly as for a real model's tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate(list(TAGS.values()) + list(words))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=TAGS["unk"]))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True)])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)   # joins tokens with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=TAGS["bos"],
                                   pad_token=TAGS["pad"], unk_token=TAGS["unk"])


def build_model(cfg, tokenizer):
    """`model: tiny` builds a small Llama from the config's n_layer/n_embd/n_head (random init,
    seeded); any other value is a local path or hub name loaded with from_pretrained."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    if cfg["model"] != "tiny":
        return AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=cfg["n_embd"],
                         intermediate_size=4 * cfg["n_embd"], num_hidden_layers=cfg["n_layer"],
                         num_attention_heads=cfg["n_head"], num_key_value_heads=cfg["n_head"],
                         max_position_embeddings=256, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.convert_tokens_to_ids(TAGS["act_end"]))
    torch.manual_seed(cfg["seed"])
    return LlamaForCausalLM(config)


def tag_ids(tokenizer):
    """The ids the sampler forces and stops on. Each forced tag is a list (a real chat template's
    hand-off is several tokens); each stop is one id."""
    def one(tag):
        return tokenizer.convert_tokens_to_ids(TAGS[tag])
    return {"bos": [one("bos")], "act": [one("act")], "env": [one("env")],
            "act_end": one("act_end"), "env_end": one("env_end"), "pad": one("pad")}


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


# ----------------------------------------------------------------------------- episodes

def encode_episode(tokenizer, prompt, calls, responses, answer=None, env_role=OBS, act_role=ACT):
    """Token ids and roles of a logged episode, segment by segment exactly as the sampler builds
    them: tags are inserted as ids, each text segment is encoded on its own.
    env_role: OBS for logged real-world responses. act_role: PROMPT for tool snippets, whose calls
    are context only (the warm start then trains the responses, not the calls)."""
    tags = tag_ids(tokenizer)
    ids, roles = [], []

    def add(tok_ids, role):
        ids.extend(tok_ids)
        roles.extend([role] * len(tok_ids))

    add(tags["bos"] + encode(tokenizer, prompt), PROMPT)
    for call, response in zip(calls, responses):
        add(tags["act"], TAG)
        add(encode(tokenizer, call) + [tags["act_end"]], act_role)
        add(tags["env"], TAG)
        add(encode(tokenizer, response) + [tags["env_end"]], env_role)
    if answer is not None:
        add(tags["act"], TAG)
        add(encode(tokenizer, f"answer {answer}") + [tags["act_end"]], act_role)
    return {"ids": ids, "roles": roles}


def collate(episodes, pad_id):
    """Right-pad a list of episodes into tensors: ids [B, L], roles [B, L] (PAD beyond the end)."""
    L = max(len(e["ids"]) for e in episodes)
    ids = torch.full((len(episodes), L), pad_id, dtype=torch.long)
    roles = torch.full((len(episodes), L), PAD, dtype=torch.long)
    for i, e in enumerate(episodes):
        ids[i, :len(e["ids"])] = torch.tensor(e["ids"])
        roles[i, :len(e["roles"])] = torch.tensor(e["roles"])
    return ids, roles


def loss_mask(roles, trained=(ACT, REHEARSE)):
    """[B, L] roles -> [B, L-1] bool: position t is trained when the token at t+1 has a trained
    role. Derived from roles only, never from pad ids (pad may equal eos in real tokenizers)."""
    target_roles = roles[:, 1:]
    return torch.isin(target_roles, torch.tensor(trained, device=roles.device))


def token_advantages(roles, episode_adv, act_coef=1.0, rehearse_coef=1.0):
    """[B, L] roles and [B] episode advantages -> [B, L-1] per-target advantage: the episode's A on
    every target, scaled by the coefficient of the target's role (0 elsewhere)."""
    target_roles = roles[:, 1:]
    coef = torch.zeros_like(target_roles, dtype=torch.float32)
    coef[target_roles == ACT] = act_coef
    coef[target_roles == REHEARSE] = rehearse_coef
    return coef * episode_adv.float()[:, None]


def micro_batches(lengths, token_budget):
    """Row indices grouped into micro-batches of similar length, so that padding costs little:
    rows sorted longest first and packed while rows x longest <= token_budget (>= 1 row each).
    lengths [50, 12, 48, 10], budget 100 -> [[0, 2], [1, 3]]: 100 + 24 tokens computed for 120."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches = [[]]
    for i in order:
        if batches[-1] and (len(batches[-1]) + 1) * lengths[batches[-1][0]] > token_budget:
            batches.append([])
        batches[-1].append(i)
    return batches


def padded_fraction(lengths, batches):
    """Share of the positions computed for `batches` (each cut to its longest row) that are padding."""
    computed = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    return 1 - sum(lengths[i] for b in batches for i in b) / computed


def token_logprobs(model, ids, temperature=1.0, with_entropy=False):
    """Logprob of every target token ids[:, 1:] under the model at `temperature`, in fp32.
    Rows are right-padded, so no attention mask is needed: with causal attention a real token
    never attends to the pads after it. Returns [B, L-1] (and entropy [B, L-1] if asked)."""
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float() / temperature   # no KV cache to build
    logp = F.log_softmax(logits, dim=-1)
    target_logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    if not with_entropy:
        return target_logp
    return target_logp, -(logp.exp() * logp).sum(-1)


def save_checkpoint(model, tokenizer, path, extra_files=None, state=None, state_dict=None):
    """save_pretrained for model and tokenizer, plus `extra_files` ({name: text}) and an optional
    trainer `state` (torch.save), written whole to <path>.tmp and then swapped in by two renames
    (<path> -> <path>.old, <path>.tmp -> <path>). A crash at any moment leaves a complete
    checkpoint at <path> or at <path>.old (find_checkpoint looks at both), never a half-written one.
    `state_dict`: the weights to write instead of the model's own (a sharded model's, gathered)."""
    tmp, old = path + ".tmp", path + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    for name, text in (extra_files or {}).items():
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
    if state is not None:
        torch.save(state, os.path.join(tmp, "trainer_state.pt"))
    if os.path.isdir(path):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def find_checkpoint(path):
    """`path`, or `path`.old if a crash struck between save_checkpoint's two renames; else None."""
    for candidate in (path, path + ".old"):
        if os.path.isfile(os.path.join(candidate, "config.json")):
            return candidate
    return None
