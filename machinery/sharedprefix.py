"""The policy's logprobs in less memory: the numbers of envace.token_logprobs, computed so that a
long shared prompt runs once and the full-vocabulary logits are never held whole (docs/speed.md).

    lean_logprobs          envace.token_logprobs's signature and numbers: what train.py's warm start and
                           update call under `lean_logprobs` (a real model's configs; the demo runs envace's)
    token_logprobs         envace.token_logprobs with `prefix`
    batch_logprobs         the no-grad old and reference logprobs of rl_step, in micro-batches
    shared_prefix_length   the ids every row of a micro-batch starts with
    shared_prefix_forward  those ids run once as one row; the rows' suffixes on their keys and values
    RecordingCache, ReadOnlyCache  the two passes' caches, unchanged by a recompute in backward
    lean_head, final_hidden        the LM head and the hidden states it is applied to
    head_logprobs          the LM head, the fp32 log-softmax and the gather in chunks of positions

Two savings that must not change a number, each compared with the plain forward (envace's) in
tests/test_shared_prefix.py: values, entropy and gradients. Whether a model may share a prefix
(not under FSDP; under gradient checkpointing only when its layers keep the cache) is
machinery/distributed.py's can_share_prefix, next to the wrapping it asks about.
"""
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache, PreTrainedModel

import envace
from machinery.distributed import LOGIT_CHUNK, can_share_prefix


def token_logprobs(model, ids, temperature=1.0, with_entropy=False, start=0, prefix=0):
    """envace.token_logprobs (the policy's logprobs of every target, fp32, 0 before `start`) in less
    memory.
    prefix: the number of leading ids every row holds alike (`shared_prefix_length`): they run
    once, as one row, and the rows' suffixes run on its keys and values (`shared_prefix_forward`);
    0, or a model `can_share_prefix` refuses, runs every row whole.
    A transformers model (one with an LM head, `lean_head`) takes the hidden states and applies the
    head in chunks of positions (`head_logprobs`): the full-vocabulary logits are never held for
    every position at once, in forward or backward. Other models (tests' fakes) take the plain
    path: their logits, cut with `logits_to_keep` where start > 0 (envace.token_logprobs)."""
    inner = model.module if isinstance(model, DDP) else model
    head = lean_head(inner)
    L = ids.shape[1]
    if head is None:
        return envace.token_logprobs(model, ids, temperature, with_entropy, start)
    if prefix and can_share_prefix(inner):
        pieces = shared_prefix_forward(model, ids, prefix)
    else:
        pieces = [(0, final_hidden(model, ids, use_cache=False))]
    outputs = []
    for first, hidden in pieces:                  # hidden [1 or B, n, H] of positions first .. first + n - 1
        lo, hi = max(start, first), min(first + hidden.shape[1], L - 1)
        if lo < hi:
            outputs.append(head_logprobs(hidden[:, lo - first:hi - first], head, ids[:, lo + 1:hi + 1],
                                         temperature, with_entropy))
    target_logp = F.pad(torch.cat([o[0] for o in outputs], 1), (start, 0))
    if not with_entropy:
        return target_logp
    return target_logp, F.pad(torch.cat([o[1] for o in outputs], 1), (start, 0))


def lean_logprobs(model, ids, temperature=1.0, with_entropy=False, start=0, share_prefix=True):
    """envace.token_logprobs (same signature, same numbers) in less memory: `token_logprobs` with the
    ids every row starts with found here (`share_prefix`; train.py binds it at setup). Rows are
    right-padded, and the prefix is capped only so that every row keeps one position for the
    suffix pass: a prefix that runs into a short row's pads holds the same ids in every row, so each
    position still gets what a forward of its whole row gives (tests/test_shared_prefix.py)."""
    prefix = shared_prefix_length(ids, [ids.shape[1]] * ids.shape[0]) if share_prefix else 0
    return token_logprobs(model, ids, temperature, with_entropy, start, prefix)


@torch.no_grad()
def batch_logprobs(model, ids, lengths, mask, temperature, micro_batch_tokens, share_prefix, tools=None):
    """No-grad fp32 logprobs of every target [B, L-1] at `temperature`, in length-grouped
    micro-batches of at most `micro_batch_tokens` (envace.micro_batches; `tools`: a row's tool,
    whose rows share a micro-batch); with a [B, L-1] `mask` (None: every target), only from each
    micro-batch's first masked target on (0 before it); with `share_prefix`, a micro-batch's
    common prefix runs once."""
    out = torch.zeros(ids.shape[0], ids.shape[1] - 1, device=ids.device)
    for index in envace.micro_batches(lengths, micro_batch_tokens, tools):
        rows = [lengths[i] for i in index]
        n = max(rows)
        index = torch.tensor(index, device=ids.device)
        start = 0 if mask is None else envace.first_target(mask[index, :n - 1])
        prefix = shared_prefix_length(ids[index, :n], rows) if share_prefix else 0
        out[index, :n - 1] = token_logprobs(model, ids[index, :n], temperature, start=start, prefix=prefix)
    return out


# ----------------------------------------------------------------------------- the shared prefix

MIN_SHARED_PREFIX = 2      # tokens; a shorter common prefix (a lone <bos>) is not worth a second forward


def shared_prefix_length(ids, lengths):
    """The number of leading ids all rows of `ids` [B, L] hold alike, within every row's real tokens
    (`lengths`) and leaving each row at least one of them after it; 0 for one row or when it is
    shorter than MIN_SHARED_PREFIX. Rows [a b c d] and [a b c e]: 3; [a b] and [a b c]: 1 -> 0."""
    if ids.shape[0] < 2:
        return 0
    same = (ids == ids[:1]).all(0).int()          # [L]: position t holds one id in every row
    n = min(int(same.cumprod(0).sum()), min(lengths) - 1)
    return n if n >= MIN_SHARED_PREFIX else 0


def shared_prefix_forward(model, ids, prefix):
    """[(0, hidden of the prefix [1, prefix, H]), (prefix, hidden of the suffixes [B, L - prefix, H])]:
    ids[:, :prefix] (the same in every row) run once as one row; its keys and values, repeated for
    the B rows (a differentiable copy: gradients flow back into the prefix pass), are the cache the
    rows' suffixes run on, at positions prefix .. L-1.
    Under DDP the prefix pass runs through the unwrapped module and the suffix pass through the
    wrapper: one DDP forward per backward, as DDP expects; the gradients of both passes reach the
    same parameters, whose hooks DDP's all-reduce rides on.
    Both caches leave what a layer holds unchanged after the first pass (`RecordingCache`,
    `ReadOnlyCache`), so a layer recomputed by gradient checkpointing reads the same keys and values."""
    inner = model.module if isinstance(model, DDP) else model
    B, L = ids.shape
    recorded = RecordingCache(config=inner.config)
    shared = final_hidden(inner, ids[:1, :prefix], cache=recorded, use_cache=True)
    cache = ReadOnlyCache(config=inner.config, ddp_cache_data=[
        (layer.keys.repeat_interleave(B, 0), layer.values.repeat_interleave(B, 0)) for layer in recorded.layers])
    positions = torch.arange(prefix, L, device=ids.device)[None].expand(B, -1)
    rest = final_hidden(model, ids[:, prefix:], cache=cache, use_cache=True, position_ids=positions)
    return [(0, shared), (prefix, rest)]


class RecordingCache(DynamicCache):
    """The prefix pass's cache: a layer's first keys and values are kept; every call returns the
    new ones as they are (the prefix attends to itself only), so a recomputed layer sees what the
    first pass saw instead of the kept keys followed by its own again."""
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx >= len(self.layers) or not self.layers[layer_idx].is_initialized:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        return key_states, value_states


class ReadOnlyCache(DynamicCache):
    """The suffix pass's cache: the prefix's keys and values (repeated for the rows), read and never
    extended: every call returns them followed by the new ones, the same in a recompute."""
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        return torch.cat([layer.keys, key_states], -2), torch.cat([layer.values, value_states], -2)


# ----------------------------------------------------------------------------- the LM head in chunks

def lean_head(model):
    """The LM head (nn.Linear) whose output is the model's logits, or None: a model that is not a
    transformers causal LM, or that scales or caps its logits after the head (Gemma 2's softcap,
    Cohere's logit_scale), which token_logprobs' chunked head would not do."""
    if not isinstance(model, PreTrainedModel):
        return None
    head = model.get_output_embeddings()
    changes_logits = any(getattr(model.config, k, None) not in (None, 1.0)
                         for k in ("final_logit_softcapping", "logit_scale"))
    return head if isinstance(head, torch.nn.Linear) and not changes_logits else None


def final_hidden(model, ids, **kw):
    """The last layer's hidden states after the final norm, [B, L, H], through `model`'s own forward
    (a DDP wrapper's too). transformers returns them as the last of `hidden_states` (`[-1]`: no
    other layer's is kept); the LM head runs on one position only (logits_to_keep=1), unused."""
    return model(input_ids=ids, output_hidden_states=[-1], logits_to_keep=1, **kw).hidden_states[-1]



def head_logprobs(hidden, head, targets, temperature=1.0, with_entropy=False):
    """The LM head, fp32 log-softmax and gather over hidden states [b, T, H] in chunks of
    positions, each under torch.utils.checkpoint: backward recomputes a chunk's logits instead of
    keeping them, so at most one chunk's logits exist at a time. b = 1 (a shared prefix: its
    logits made once) or B; targets [B, T]. Returns (logprobs [B, T], entropy [B, T] or None)."""
    B, T = targets.shape
    step = max(1, LOGIT_CHUNK // (hidden.shape[0] * head.out_features))

    def chunk(h, weight, bias, target):
        logits = F.linear(h, weight, bias).float() / temperature
        logp = F.log_softmax(logits, dim=-1)
        target_logp = logp.expand(B, -1, -1).gather(-1, target[..., None]).squeeze(-1)
        if not with_entropy:
            return target_logp, None
        return target_logp, (-(logp.exp() * logp).sum(-1)).expand(B, -1)
    parts = [checkpoint(chunk, hidden[:, s:s + step], head.weight, head.bias, targets[:, s:s + step],
                        use_reentrant=False)
             for s in range(0, T, step)]
    return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1) if with_entropy else None
