"""The sampler's batch decoders and their KV caches (docs/speed.md). The sampler asks `decoder` for
one per sampling call (rollout._start_decoders), which picks it from the rows' prefixes:

    PlainDecoder  prefixes shorter than PLAIN_BELOW ids (the demo's toy prompts: 3-8 ids):
                  transformers' own DynamicCache, every row prefilled whole (left-padded), each
                  step's runs right-aligned in one forward, finished rows dropped (`keep`)
    Decoder       longer prefixes (a chat model's system turn and tool schemas: hundreds to
                  thousands of ids), and rows restored from a separate round's saved cache: the
                  same steps, with the speed tricks below

Both feed every row the same ids at the same positions (tests/test_kvcache.py: the same sampled
tokens and logprobs). Why the demo takes the plain one: the tricks below pay with the prompt's
length, and at the demo's they pay nothing. A demo-shaped random Llama (1.06M parameters), 16
prefixes x 8 rows then 40 one-id steps, took plain / Decoder 0.93x the time at 5-id prefixes,
1.06x at 8, 1.12x at 16, 1.57x at 64, 2.90x at 256 (most of it Decoder's one prefill per distinct
prefix); the demo's own sampling of 16 tasks x 8 (a trained warm start), the two timed in turn,
0.95x in rehearse mode and 0.96x in real mode, the same episodes bit for bit (docs/speed.md:
1 thread, 2 AMD EPYC cores, 2026-12-07).

transformers' DynamicLayer concatenates the whole cache at every decode step (a copy of every
layer's keys and values per step); at 2k-token chat prompts that copy was a third of a sampling
call in cProfile (`torch.cat` 3.8 of 11.1 s, real mode, 2 chat tasks x 4), with GrowingLayer 0.07
of 3.1 s. GrowingLayer keeps keys and values in a buffer with room to grow (doubled when full)
and writes each step into it.

A step feeds each row its run of ids in one [B, longest run] forward. Where a few rows run a long
one (a forced real response, ~25 ids) while the others feed one id, that forward computes a hole
for every other row at each of its positions: in real-mode evaluation of the separate layout's
SmolLM2 warm start (40 test tasks, 1 thread) 28 such steps took 131.5 of 218 s. `Decoder.step`
runs them as two forwards (every row's first id, then the longer runs on a copy of their rows'
cache, `_step_rows`): 46.7 s, the same episodes. Only where the holes cost more than a second
forward (SPLIT_COST): on the demo's 1M-parameter model they do not, and splitting there saved
nothing (the whole demo side by side, one thread each: 184.15 s CPU split, 183.31 s not) while
the other matmul shapes moved its sampled tokens' logprobs by up to 2.6e-6, and so its figures.

save_row / restore_rows keep the cache of a separate-layout actor row paused at its call
(rollout._save_paused) for the next round of separate.sample_separate, which then feeds it only
the ids appended since (the copied response), where it was re-prefilled every round before
(test_actor_rows_keep_their_cache_across_rounds: 3 prefills instead of 7). Both decoders save;
restored rows go to Decoder. Only for caches of full-attention layers (else the rows are
prefilled again).
"""
import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from machinery.sharedprefix import shared_prefix_length

# ids: `decoder` gives shorter prefixes to PlainDecoder. 16 is MIN_SHARED (Decoder runs no shared
# prefix below it); below it the plain one took 0.93-1.12x Decoder's time, on the demo's 0.95x (above)
PLAIN_BELOW = 16


def decoder(model, prefixes, pad_id, saved=None):
    """The sampler's decoder over `prefixes` (id lists): PlainDecoder where every prefix is shorter
    than PLAIN_BELOW ids, else Decoder, whose speed tricks pay on long prompts; rows restored
    from `saved` (separate rounds' kept caches, save_row) go to Decoder."""
    if saved is None and max(map(len, prefixes)) < PLAIN_BELOW:
        return PlainDecoder(model, prefixes, pad_id)
    return Decoder(model, prefixes, pad_id, saved)


class PlainDecoder:
    """A batch of rows and their KV cache (transformers' DynamicCache), advanced by one run of ids
    per row per step: a sampled token and the forced ids queued after it; a finished row none.
    The runs are right-aligned in one [B, longest run] forward; the shorter runs' slots (and the
    prefill's left pads) are holes, masked out and never attended to, so every row's cache holds
    exactly its own ids at its own positions. The prefill is the first step: the prefixes."""

    def __init__(self, model, prefixes, pad_id):
        self.model, self.pad_id, self.cache = model, pad_id, DynamicCache(config=model.config)
        device = next(model.parameters()).device
        self.mask = torch.zeros(len(prefixes), 0, dtype=torch.long, device=device)   # 1 an id, 0 a hole
        self.pos = torch.zeros(len(prefixes), dtype=torch.long, device=device)       # each row's next position
        self.step([list(p) for p in prefixes])

    @torch.no_grad()
    def step(self, runs):
        """Append each row's run of ids (a list per row); returns the logits after each row's last
        id [B, V]: the LM head runs on that position only (test fakes take no `logits_to_keep`)."""
        width = max(map(len, runs))
        ids = torch.tensor([[self.pad_id] * (width - len(r)) + r for r in runs], device=self.mask.device)
        new = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in runs], device=self.mask.device)
        self.mask = torch.cat([self.mask, new], 1)
        positions = self.pos[:, None] + (new.cumsum(1) - 1).clamp(min=0)     # a hole's: any (masked)
        last = {"logits_to_keep": 1} if isinstance(self.model, PreTrainedModel) else {}
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=positions, cache=self.cache,
                         use_cache=True, **last)
        self.logits, self.pos = out.logits[:, -1].float(), self.pos + new.sum(1)
        return self.logits

    def keep(self, index):
        """Keep the batch rows at `index` (a LongTensor); the others leave the cache."""
        self.cache.batch_select_indices(index)
        self.mask, self.pos, self.logits = self.mask[index], self.pos[index], self.logits[index]

    def save(self, j):
        """Row j's cache as plain tensors (save_row), for a Decoder to restore."""
        return save_row(self.cache, self.mask, self.pos, j)


class GrowingLayer(DynamicLayer):
    """A KV cache layer whose keys and values live in a buffer with room to grow (doubled when
    full): appending a step writes into it, where transformers' DynamicLayer concatenates."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.buffers, self.length = None, 0
        n = self.length + key_states.shape[-2]
        if self.buffers is None or n > self.buffers[0].shape[-2]:
            room = max(2 * n, 64)
            grown = []
            for old, new in ((self.keys, key_states), (self.values, value_states)):
                buf = new.new_empty(*new.shape[:-2], room, new.shape[-1])   # read only up to n
                if self.length:
                    buf[..., :self.length, :] = old
                grown.append(buf)
            self.buffers = grown
        self.buffers[0][..., self.length:n, :] = key_states
        self.buffers[1][..., self.length:n, :] = value_states
        self.length = n
        self.keys, self.values = self.buffers[0][..., :n, :], self.buffers[1][..., :n, :]
        return self.keys, self.values

    def batch_select_indices(self, indices):
        if self.length:
            self.buffers = [b[indices, ...] for b in self.buffers]
            self.keys, self.values = self.buffers[0][..., :self.length, :], self.buffers[1][..., :self.length, :]


def new_cache(config):
    """A DynamicCache of GrowingLayer (the plain one where a model has other kinds of layers)."""
    cache = DynamicCache(config=config)
    if all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [GrowingLayer() for _ in cache.layers]
    return cache


def save_row(cache, mask, pos, j):
    """Batch row j of a sampler's cache as plain tensors (keys and values per layer, mask, next
    position), for restore_rows; None where the cache has layers of another kind (sliding)."""
    if not all(isinstance(layer, DynamicLayer) and not layer.is_sliding for layer in cache.layers):
        return None
    return {"kv": [(layer.keys[j:j + 1].clone(), layer.values[j:j + 1].clone()) for layer in cache.layers],
            "mask": mask[j:j + 1], "pos": pos[j:j + 1]}


def restore_rows(config, saved, device):
    """(cache, mask, positions) of rows from save_row, left-padded to the longest (pads masked)."""
    T = max(s["mask"].shape[1] for s in saved)

    def left_pad(x, dim):                         # zeros on the left of dimension `dim`
        pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [T - x.shape[dim], 0]
        return F.pad(x, pad)
    cache = new_cache(config)
    for l, layer in enumerate(cache.layers):
        layer.update(torch.cat([left_pad(s["kv"][l][0], -2) for s in saved]),
                     torch.cat([left_pad(s["kv"][l][1], -2) for s in saved]))
    return (cache, torch.cat([left_pad(s["mask"], 1) for s in saved]).to(device),
            torch.cat([s["pos"] for s in saved]).to(device))


MIN_SHARED = 16     # ids; a shorter common start of the prefixes is prefilled with the rest
# a forward's fixed cost in hole positions x parameters, above which a step runs the longer runs
# apart (Decoder.step): a forward costs about what 60 positions cost on top of what its positions
# cost on SmolLM2-135M (134.5M parameters, one CPU thread), taken as 64 such positions
SPLIT_COST = 64 * 134_500_000


def n_parameters(model):
    return sum(p.numel() for p in model.parameters())


class Decoder:
    """PlainDecoder's rows and steps with the speed tricks of long prompts (`decoder` picks it for
    the sampler; worldmodel/honesty.py's greedy decoding uses it directly). Identical prefixes (a
    task's G samples) are prefilled once and their cache rows copied; the ids that all prefixes
    start with (a chat prompt's system turn and tool schemas, the same for every task) are
    prefilled once as one row, copied, and each prefix's rest fed as a step; the cache grows in
    place (GrowingLayer); a step whose holes would cost more than a second forward runs as two
    (`step`, SPLIT_COST). As in PlainDecoder, `keep` drops finished rows and a step's runs are
    right-aligned, the shorter runs' slots masked holes. Rows can also be restored from the KV
    `save` kept for them (separate rounds: no re-prefill), or taken over from a cache filled
    elsewhere (`resume`)."""

    def __init__(self, model, prefixes, pad_id, saved=None):
        self.model, self.pad_id = model, pad_id
        device = next(model.parameters()).device
        if saved is not None:                         # rows restored from save(): cache, mask, positions
            self.cache, self.mask, self.pos = restore_rows(model.config, saved, device)
            return
        unique = {p: i for i, p in enumerate(dict.fromkeys(map(tuple, prefixes)))}
        self.cache = new_cache(model.config)
        rows = [list(p) + [pad_id] * (max(map(len, unique)) - len(p)) for p in unique]   # right-padded
        shared = shared_prefix_length(torch.tensor(rows), [len(p) for p in unique])
        # the ids every prefix starts with run once (a transformers model; tests' scripted fakes
        # tell rows apart by their prefill, so they get the plain one)
        if shared >= MIN_SHARED and len(unique) > 1 and isinstance(model, PreTrainedModel):
            first = torch.tensor([list(unique)[0][:shared]], device=device)
            self.mask = torch.ones_like(first)
            self.keep(torch.zeros(len(unique), dtype=torch.long, device=device), self._forward(first, None))
            self.pos = torch.full((len(unique),), shared, device=device)
            logits = self.step([list(p[shared:]) for p in unique])      # the rest: runs right-aligned
        else:
            P = max(len(p) for p in unique)
            ids = torch.full((len(unique), P), pad_id, dtype=torch.long, device=device)
            mask = torch.zeros((len(unique), P), dtype=torch.long, device=device)
            for p, i in unique.items():
                ids[i, P - len(p):] = torch.tensor(p, device=device)
                mask[i, P - len(p):] = 1                   # left pads masked
            self.mask = mask
            logits = self._forward(ids, (mask.cumsum(1) - 1).clamp(min=0))
        if len(unique) < len(prefixes):               # each row: a copy of its prefix's cache
            self.keep(torch.tensor([unique[tuple(p)] for p in prefixes], device=device), logits)
        else:
            self.logits = logits
        self.pos = torch.tensor([len(p) for p in prefixes], device=device)

    @classmethod
    def resume(cls, model, pad_id, cache, mask, pos, logits):
        """A Decoder over a cache filled elsewhere (honesty.greedy_hits' teacher-forced pass): row j
        holds the ids at the columns mask[j] marks, its next id goes at position pos[j], and
        logits[j] are the logits after its last id."""
        decoder = cls.__new__(cls)
        decoder.model, decoder.pad_id, decoder.cache = model, pad_id, cache
        decoder.mask, decoder.pos, decoder.logits = mask, pos, logits
        return decoder

    @torch.no_grad()
    def _forward(self, ids, position_ids):
        # only the last position's logits are read: the LM head on every fed position would hold
        # rows x run x vocab floats (a 200-row prefill of 430-token prompts, 49k vocab: 17 GB)
        last = {"logits_to_keep": 1} if isinstance(self.model, PreTrainedModel) else {}   # (test fakes: no key)
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=position_ids,
                         cache=self.cache, use_cache=True, **last)
        return out.logits[:, -1].float()

    def keep(self, index, logits=None):
        """Keep (or copy) the batch rows at `index` (a LongTensor): cache, mask, logits."""
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        self.logits = (self.logits if logits is None else logits)[index]
        if logits is None:
            self.pos = self.pos[index]

    def step(self, runs):
        """Append each row's run of ids (a list per row, at least one row non-empty); returns the
        logits after each row's last id [B, V] (a row with an empty run: after a hole, unused).
        Where one forward's holes would cost more than SPLIT_COST (a few rows run a real
        response while the others feed one id, on a model the size of SmolLM2), every row feeds
        its first id, then only the rows with more feed the rest, on a copy of their cache
        (`_step_rows`)."""
        width = max(map(len, runs))
        longer = [j for j, r in enumerate(runs) if len(r) > 1]
        holes = (len(runs) - len(longer)) * (width - 1)
        if holes == 0 or holes * n_parameters(self.model) <= SPLIT_COST or not self._can_split():
            return self._step(runs)
        self._step([r[:1] for r in runs])
        return self._step_rows(longer, [runs[j][1:] for j in longer])

    # step's one forward, the runs right-aligned in [B, longest run]: PlainDecoder's step itself (the
    # same ids, holes, positions and cache call), on this decoder's mask, positions and cache
    _step = PlainDecoder.step

    def _can_split(self):
        return all(type(layer) is GrowingLayer for layer in self.cache.layers)

    def _step_rows(self, rows, runs):
        """Append runs to the batch rows `rows` only: one forward of those rows over a copy of their
        cache; every other row gets as many hole columns (its last keys and values repeated:
        masked, and a test's scripted model reads its state from the last column)."""
        index = torch.tensor(rows, device=self.mask.device)
        part = DynamicCache()
        for l, layer in enumerate(self.cache.layers):
            part.update(layer.keys[index], layer.values[index], l)
        sub = Decoder.resume(self.model, self.pad_id, part, self.mask[index], self.pos[index], None)
        sub._step(runs)
        width = sub.mask.shape[1] - self.mask.shape[1]
        for layer, fed in zip(self.cache.layers, part.layers):
            added = []
            for old, new in ((layer.keys, fed.keys), (layer.values, fed.values)):
                columns = old[..., -1:, :].repeat_interleave(width, -2)
                columns[index] = new[..., -width:, :]
                added.append(columns)
            layer.update(*added)
        new = torch.zeros(self.mask.shape[0], width, dtype=self.mask.dtype, device=self.mask.device)
        new[index] = sub.mask[:, -width:]
        self.mask = torch.cat([self.mask, new], 1)
        self.pos, self.logits = self.pos.clone(), self.logits.clone()
        self.pos[index], self.logits[index] = sub.pos, sub.logits
        return self.logits

    def save(self, j):
        """Row j's cache as plain tensors (save_row), so that a later Decoder can restore it."""
        return save_row(self.cache, self.mask, self.pos, j)
