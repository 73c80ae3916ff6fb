"""The sampler's KV cache (the speed extension of issue 16; docs/speed.md): a cache that grows in
place, and rows of a batch's cache taken out and put back.

transformers' DynamicLayer concatenates the whole cache at every decode step (a copy of every
layer's keys and values per step); at 2k-token chat prompts that copy was a third of a sampling
call in cProfile (`torch.cat` 3.8 of 11.1 s, real mode, 2 chat tasks x 4), with GrowingLayer 0.07
of 3.1 s. GrowingLayer keeps keys and values in a buffer with room to grow (doubled when full)
and writes each step into it.

take / put move rows between a batch's cache and plain tensors, for the separate layout
(separate.sample_separate): an actor row paused at its call is taken out of its batch row (slot),
its rehearse row's prefill is put in the same slot and decodes in the same forwards as the other
rows, and when the rehearsal ends the actor row is put back and goes on from its own cache (no
re-prefill). A block is put right-aligned (its last column at the batch's last); the columns left
of it are masked holes, like a left-padded prompt's. Only for caches of full-attention layers.
"""
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


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
        if self.length:                       # copy only the filled columns, keep the room
            self.buffers = [self._select(b, indices) for b in self.buffers]
            self.keys, self.values = self.buffers[0][..., :self.length, :], self.buffers[1][..., :self.length, :]

    def _select(self, buffer, indices):
        out = buffer.new_empty(len(indices), *buffer.shape[1:])
        out[..., :self.length, :] = buffer[indices, ..., :self.length, :]
        return out


def new_cache(config):
    """A DynamicCache of GrowingLayer (the plain one where a model has other kinds of layers)."""
    cache = DynamicCache(config=config)
    if all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [GrowingLayer() for _ in cache.layers]
    return cache


def full_attention(cache):
    return all(isinstance(layer, DynamicLayer) and not layer.is_sliding for layer in cache.layers)


def take(decoder, slots=None):
    """The cache of batch rows `slots` (a LongTensor) of a rollout._Decoder as plain tensors: keys
    and values per layer, mask, next position and logits (copies; slots None: all rows, no copy)."""
    def rows(x):
        return x if slots is None else x[slots]
    return {"kv": [(rows(layer.keys), rows(layer.values)) for layer in decoder.cache.layers],
            "mask": rows(decoder.mask), "pos": rows(decoder.pos), "logits": rows(decoder.logits)}


def put(decoder, slots, block, rows=None):
    """Write rows `rows` (a LongTensor; default all) of a taken `block` into batch rows `slots` of
    `decoder`, right-aligned; the slots' columns left of it become masked holes. A block longer
    than the batch's cache first grows the batch by hole columns (`grow`)."""
    rows = torch.arange(len(block["pos"]), device=block["pos"].device) if rows is None else rows
    t, T = block["mask"].shape[1], decoder.mask.shape[1]
    if t > T:
        grow(decoder, t - T)
        T = t
    for layer, (keys, values) in zip(decoder.cache.layers, block["kv"]):
        layer.keys[slots, :, T - t:] = keys[rows]        # in place: the views write into the buffers
        layer.values[slots, :, T - t:] = values[rows]
    decoder.mask[slots] = 0
    decoder.mask[slots, T - t:] = block["mask"][rows]
    decoder.pos[slots] = block["pos"][rows]
    decoder.logits[slots] = block["logits"][rows]


def grow(decoder, n):
    """Append n masked hole columns to every row of the decoder's cache. Each holds a copy of the
    row's last column (masked: any value would do; the tests' scripted fake LMs read the last)."""
    for layer in decoder.cache.layers:
        layer.update(layer.keys[..., -1:, :].expand(-1, -1, n, -1).clone(),
                     layer.values[..., -1:, :].expand(-1, -1, n, -1).clone())
    decoder.mask = torch.cat([decoder.mask, decoder.mask.new_zeros(len(decoder.mask), n)], 1)
