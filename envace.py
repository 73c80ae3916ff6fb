"""The trajectory format: one episode = one token sequence, one role per token.

This is the data structure of the paper's world rehearsal: a single policy writes both
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
import functools

import torch
import torch.nn.functional as F

PROMPT, ACT, REHEARSE, OBS, TAG, PAD = range(6)
ROLE_NAMES = ["prompt", "act", "rehearse", "obs", "tag", "pad"]
# who writes an episode's environment segments (config key env_mode): the policy (REHEARSE, trained),
# the real world (OBS), a frozen copy of the warm start (OBS), or nobody (an empty response, OBS)
ENV_MODES = ("rehearse", "real", "frozen", "none")
TAGS = {"bos": "<bos>", "pad": "<pad>", "unk": "<unk>", "act": "<act>", "act_end": "</act>",
        "env": "<env>", "env_end": "</env>"}


class NonFiniteError(Exception):
    """Weights, a loss or logits that are not finite (NaN or inf) where the run cannot go on: the
    warm start's three skipped steps in a row, its weights before they are saved, the policy's
    logits while sampling. train.main and evaluate_cli.main print it as one line and exit 1."""


def world_is_sampled(env_mode):
    """Whether env_mode's responses are sampled token by token (by the policy or the frozen warm
    start) rather than written whole at the call (the real world's, or none's empty one): the one
    place env_mode's modes are told apart (the sampler, the layouts, the diagnostics, the gate)."""
    assert env_mode in ENV_MODES, env_mode
    return env_mode in ("rehearse", "frozen")


def tag_ids(tokenizer):
    """The ids the sampler forces and stops on, in the form chat.chat_format derives from a chat
    template: each forced hand-off is a list (a template's is several tokens; first_act is the
    one after the prompt), each stop one id, the text a role writes before its stop (none here),
    and `stops`, the tags no role may write itself."""
    def one(tag):
        return tokenizer.convert_tokens_to_ids(TAGS[tag])
    tags = {"bos": [one("bos")], "first_act": [one("act")], "act": [one("act")], "env": [one("env")],
            "act_end": one("act_end"), "env_end": one("env_end"), "pad": one("pad"), "act_pre": "", "env_pre": "",
            "env_lead": ""}
    tags["stops"] = set(tags["act"] + tags["env"] + tags["bos"] + [tags["pad"], tags["act_end"], tags["env_end"]])
    return tags


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


@functools.lru_cache(maxsize=1 << 16)
def decoded(tokenizer, ids):
    """tokenizer.decode of a segment (a tuple of ids): a group's rows write the same calls and
    responses, so the sampler decodes each once."""
    return tokenizer.decode(list(ids))


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
    """Paper, both roles trained: [B, L] roles -> [B, L-1] bool: position t is trained when the
    token at t+1 has a trained role. Derived from roles only, never from pad ids (pad may equal
    eos in real tokenizers)."""
    target_roles = roles[:, 1:]                  # the logits at t predict the token at t+1: shift by one
    return torch.isin(target_roles, torch.tensor(trained, device=roles.device))


def token_advantages(roles, episode_adv, act_coef=1.0, rehearse_coef=1.0):
    """Paper, one task reward for both roles: [B, L] roles and [B] episode advantages -> [B, L-1]
    per-target advantage: the episode's A on every target, scaled by the coefficient of the
    target's role (0 elsewhere)."""
    target_roles = roles[:, 1:]                  # same shift as loss_mask: target t+1 at position t
    coef = torch.zeros_like(target_roles, dtype=torch.float32)
    coef[target_roles == ACT] = act_coef
    coef[target_roles == REHEARSE] = rehearse_coef
    return coef * episode_adv.float()[:, None]


def micro_batches(lengths, token_budget, groups=None):
    """Row indices grouped into micro-batches of similar length, so that padding costs little:
    rows sorted longest first and packed while rows x longest <= token_budget (>= 1 row each).
    lengths [50, 12, 48, 10], budget 100 -> [[0, 2], [1, 3]]: 100 + 24 tokens computed for 120.
    `groups` (a key a row; None: one group): rows of different keys never share a micro-batch.
    Separate rehearse rows carry the tool they play ("tool"): a micro-batch of one tool's rows
    starts with that tool's system turn in every row, which then runs once (share_prefix).
    lengths [50, 12, 48, 10], groups [a, b, b, a], budget 100 -> [[0, 3], [2, 1]]."""
    groups = groups or [""] * len(lengths)
    order = sorted(range(len(lengths)), key=lambda i: (groups[i], -lengths[i]))
    batches = [[]]
    for i in order:
        last = batches[-1]
        if last and (groups[i] != groups[last[0]] or (len(last) + 1) * lengths[last[0]] > token_budget):
            batches.append([])
        batches[-1].append(i)
    return batches


def padded_fraction(lengths, batches):
    """Share of the positions computed for `batches` (each cut to its longest row) that are padding."""
    computed = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    return 1 - sum(lengths[i] for b in batches for i in b) / computed


def token_logprobs(model, ids, temperature=1.0, with_entropy=False, start=0):
    """Paper, the policy's logprobs (old, new, reference): of every target token ids[:, 1:] under
    the model at `temperature`, in fp32.
    Rows are right-padded, so no attention mask is needed: with causal attention a real token
    never attends to the pads after it. Returns [B, L-1] (and entropy [B, L-1] if asked).
    start: the first target position wanted (`first_target`); the LM head, the softmax and the
    gather run only from there on (on a 2k-token prompt of tool schemas that is most of a chat
    row's logits), and positions before it are 0.
    This is the plain path: the model's logits, cut with `logits_to_keep` where start > 0, whole
    for every position at once. train.py takes the same numbers in less memory (a prefix every row
    shares run once, the LM head in chunks of positions) from machinery/sharedprefix.py's
    token_logprobs."""
    L = ids.shape[1]
    keep = L - start                          # positions start .. L-1; the last one predicts nothing
    cut = {"logits_to_keep": keep} if start else {}    # (a test's fake model may not take the key)
    logits = model(input_ids=ids, use_cache=False, **cut).logits
    logits = logits[:, -keep:-1].float() / temperature              # no KV cache to build
    logp = F.log_softmax(logits, dim=-1)
    target_logp = F.pad(logp.gather(-1, ids[:, start + 1:, None]).squeeze(-1), (start, 0))
    if not with_entropy:
        return target_logp
    return target_logp, F.pad(-(logp.exp() * logp).sum(-1), (start, 0))


def first_target(mask):
    """[B, T] bool over targets -> the first position any row needs (0 if none): what
    token_logprobs may start at, since every earlier target is a prompt token with no loss."""
    needed = mask.any(0)
    return int(needed.int().argmax()) if bool(needed.any()) else 0


# ----------------------------------------------------------------------------- the loss


def clipped_pg_loss(new_logprobs, old_logprobs, advantages, loss_mask, n_tokens, ref_logprobs=None,
                    eps_low=0.2, eps_high=0.2, dual_clip=3.0, kl_coef=0.0):
    """Paper, the objective (the official code's PPO loss): the clipped surrogate with dual clip
    and a k3 KL to a reference, per token, summed over the trained tokens and divided by
    `n_tokens`, the count of trained tokens in the WHOLE batch (all micro-batches, all ranks),
    so that accumulating micro-batches gives the one-big-batch gradient.

    All inputs are [B, T] (targets); loss_mask is bool. Returns (loss, stats); every stat is also
    a sum over this micro-batch divided by n_tokens, so stats of micro-batches add up too.

    Worked example (eps 0.2, dual clip 3):  A = +1, ratio 1.5 -> loss -1.2 (clipped at 1+eps);
    A = -1, ratio 0.5 -> loss 0.8 (clipped at 1-eps); A = -1, ratio 5 -> loss 3 (dual clip).
    kl_coef: a number, or [B, T] per target (train.py gives each token its role's coefficient:
    `token_kl_coefs`)."""
    mask = loss_mask.float()
    log_ratio = new_logprobs - old_logprobs
    ratio = torch.exp(log_ratio)                                   # pi_new / pi_old, per token
    surr = -advantages * ratio                                     # policy-gradient surrogate (as a loss)
    surr_clipped = -advantages * ratio.clamp(1 - eps_low, 1 + eps_high)  # no credit beyond the trust region
    ppo = torch.maximum(surr, surr_clipped)                        # pessimistic bound: PPO's clip
    dual = torch.minimum(ppo, -advantages * dual_clip)             # A < 0: loss capped at c|A| if ratio >> 1
    per_token = torch.where(advantages < 0, dual, ppo)             # dual clip applies to negative A only
    kl = torch.zeros_like(per_token)
    if ref_logprobs is not None:
        d = ref_logprobs - new_logprobs
        kl = torch.exp(d) - d - 1                                  # k3 estimator of KL(new || ref), >= 0
        per_token = per_token + kl_coef * kl
    loss = (per_token * mask).sum() / n_tokens
    with torch.no_grad():
        stats = {
            "clip_frac": ((surr_clipped > surr) * mask).sum().item() / n_tokens,
            "dual_clip_frac": (((advantages < 0) & (dual < ppo)) * mask).sum().item() / n_tokens,
            "approx_kl": ((-log_ratio) * mask).sum().item() / n_tokens,   # k1 estimate of KL(old || new)
            "kl_ref": (kl * mask).sum().item() / n_tokens,
        }
    return loss, stats


def token_kl_coefs(roles, kl_coef, kl_rehearse_coef):
    """[B, L] roles -> [B, L-1] coefficient of the KL to the reference per target: `kl_coef` on
    ACT targets, `kl_rehearse_coef` on REHEARSE targets, 0 elsewhere. The KL is added only where
    the loss mask is, so a role whose coefficient (act_coef/rehearse_coef) is 0 gets none."""
    # token_advantages with A = 1 per row puts each role's coefficient on its targets, with the
    # same shift by one as the advantages (target t+1 is predicted at position t)
    return token_advantages(roles, torch.ones(roles.shape[0]), kl_coef, kl_rehearse_coef)
