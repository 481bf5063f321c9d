"""Continuous-batching decoding with the lean forward: the target's answers for regenerated training data.

HF ``generate`` runs a batch until its longest answer ends, so every row that stopped early keeps
computing (about half the decode compute on chit-chat answers), and its cache grows by concatenation
(copying the whole cache at every step). Here:
- each row owns a slot of a preallocated KV cache; its tokens sit at indices 0..n-1 (no left padding);
- a row leaves the batch the step it stops, and a waiting request takes its slot: a refill prefills the
  new prompts (unpadded, attention per prompt) and writes their keys and values into the free slots;
- the active rows are kept in the first slots, so attention reads a view of the cache, never a copy;
- grouped-query heads attend without repeating the keys.
The layers are the lean forward's own (``project`` / ``finish``), so the numbers are the capture's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from .base import LeanForward, segment_attention

_MIN_PREFIX = 4  # shorter common prefixes are not worth keeping


@dataclass(eq=False)  # rows are told apart by identity
class _Row:
    key: Any
    prompt: list[int]
    seed: int  # this row's own sampling generator: an answer does not depend on its batch (or on a resume)
    tokens: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


def sample_rows(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of (unnormalised) probabilities [n, V]: one uniform draw from each row's own
    generator, then inverse-CDF sampling for all rows at once (a row's draw never depends on the others)."""
    u = torch.stack([torch.rand((), generator=g, device=probs.device) for g in generators])
    cdf = probs.cumsum(-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=probs.shape[-1] - 1)[:, 0]


def top_p_filter(probs: torch.Tensor, top_p: float, first: int = 1024) -> torch.Tensor:
    """Each row's distribution on its smallest set of likeliest tokens holding ``top_p`` of the mass (not
    renormalised). Rows whose ``first`` likeliest tokens reach top_p avoid a sort of the whole vocabulary."""
    top, index = probs.topk(min(first, probs.shape[-1]), dim=-1)
    cum = top.cumsum(-1)
    short = cum[:, -1] < top_p  # the set reaches past the first tokens: sort these rows whole
    if bool(short.any()):
        full, full_index = probs[short].sort(dim=-1, descending=True)
        kept = full.masked_fill(full.cumsum(-1) - full > top_p, 0.0)
        out_short = torch.zeros_like(probs[short]).scatter(-1, full_index, kept)
    kept = top.masked_fill(cum - top > top_p, 0.0)
    out = torch.zeros_like(probs).scatter(-1, index, kept)
    if bool(short.any()):
        out[short] = out_short
    return out


class SlotCache:
    """Keys and values per layer, [slots, kv_heads, length, head_dim]; grows its length on demand."""

    def __init__(self, num_layers: int, slots: int, kv_heads: int, head_dim: int, length: int, dtype, device):
        shape = (slots, kv_heads, length, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]

    def reserve(self, length: int) -> None:
        """Room for ``length`` tokens per slot (doubling, so growth is rare)."""
        if length <= self.length:
            return
        new = max(length, 2 * self.length)
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                grown = t.new_zeros(t.shape[0], t.shape[1], new, t.shape[3])
                grown[:, :, : t.shape[2]] = t
                store[i] = grown

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot ``src``'s first ``length`` entries into slot ``dst`` (compacting the active rows)."""
        for store in (self.keys, self.values):
            for t in store:
                t[dst, :, :length] = t[src, :, :length]


class LeanDecoder:
    """``stream(queue)`` takes ``(key, prompt token ids, seed)`` from ``queue`` (anything with ``len`` and
    ``pop``, such as data.regenerate.PromptQueue) and yields ``(key, answer token ids)`` as rows finish;
    prompts pushed while it runs (an answer's follow-up turn) are taken as slots free up.

    ``head`` maps final-norm states [N, H] to float32 full-vocabulary logits (targets.teacher.LogitHead)."""

    def __init__(self, lean: LeanForward, head: Callable[[torch.Tensor], torch.Tensor], slots: int,
                 max_new_tokens: int, stop_ids: set[int], temperature: float = 0.0, top_p: float = 1.0):
        if slots < 1:
            raise ValueError(f"continuous batching needs at least one slot (data.generation.batch_size), got {slots}")
        self.lean, self.head = lean, head
        self.slots, self.max_new_tokens = slots, max_new_tokens
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long)
        self._stops = set(stop_ids)
        self.temperature, self.top_p = temperature, top_p
        self.num_layers = len(lean.layers)
        self.tokens_generated = 0  # answer tokens, the stop token included
        self.decode_rows = 0  # row-steps computed: equal to tokens_generated (no row computes past its end)
        self._cache: SlotCache | None = None
        self._prefix: list[int] = []  # the prompts' shared prefix, whose keys/values are computed once
        self._prefix_kv: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    # ---- the loop --------------------------------------------------------------------------------
    @torch.no_grad()
    def stream(self, queue) -> Iterator[tuple[Any, list[int]]]:
        rows: list[_Row] = []  # rows[i] lives in slot i
        lengths = torch.zeros(self.slots, dtype=torch.long)  # tokens held in each slot's cache
        while rows or len(queue):
            fresh = [_Row(*queue.pop()) for _ in range(min(self.slots - len(rows), len(queue)))]
            active = len(rows)
            tokens = self._step(rows, fresh, lengths)
            lengths[:active] += 1
            self.decode_rows += active + len(fresh)  # every row that got a token this step
            rows += fresh
            done = self._append(rows, tokens)
            # finished rows leave; the last active rows move into their slots (kept compact)
            for i in sorted((rows.index(r) for r in done), reverse=True):
                row, last_slot = rows[i], len(rows) - 1
                if i != last_slot:
                    self._cache.move(last_slot, i, int(lengths[last_slot]))
                    lengths[i] = lengths[last_slot]
                    rows[i] = rows[last_slot]
                rows.pop()
                yield row.key, self._answer(row)

    def _answer(self, row: _Row) -> list[int]:
        return row.tokens[:-1] if row.tokens and row.tokens[-1] in self._stops else row.tokens

    def _append(self, rows: list[_Row], tokens: torch.Tensor) -> list[_Row]:
        """Record each row's new token; the rows that are finished (stop token or max_new_tokens)."""
        done = []
        stop = torch.isin(tokens, self.stop_ids).tolist()
        for row, token, stopped in zip(rows, tokens.tolist(), stop):
            row.tokens.append(token)
            self.tokens_generated += 1
            if stopped or len(row.tokens) >= self.max_new_tokens:
                done.append(row)
        return done

    # ---- one forward -----------------------------------------------------------------------------
    def _step(self, rows: list[_Row], fresh: list[_Row], lengths: torch.Tensor) -> torch.Tensor:
        """One forward over the active rows' last tokens and the new prompts together (one flat sequence,
        so every projection and MLP runs as one matmul): the active rows attend to their cached keys, the
        new prompts causally to themselves and fill their slots. Returns the next token of every row,
        active rows first."""
        lean, device = self.lean, self._device
        n = len(rows)
        starts = [self._reuse_prefix(r, n + j) for j, r in enumerate(fresh)]  # tokens already in the slot
        sizes = [len(r.prompt) for r in fresh]
        ids = [r.tokens[-1] for r in rows] + [t for r, a in zip(fresh, starts) for t in r.prompt[a:]]
        positions = torch.cat([lengths[:n]] + [torch.arange(a, m) for a, m in zip(starts, sizes)]).to(device)
        h = lean.embed(torch.tensor(ids, device=device))[None]
        if fresh:
            lengths[n : n + len(fresh)] = torch.tensor(sizes)
        rope = lean.rope(h, positions)
        key_pos = torch.arange(int(lengths[: n + len(fresh)].max()) + 1, device=device)
        slots = torch.arange(n, device=device)
        for i in range(self.num_layers):
            q, k, v = lean.project(i, h, rope)  # [1, heads, n + new prompt tokens, d]
            parts = []
            if n:
                parts.append(self._attend_cached(i, q[:, :, :n], k[:, :, :n], v[:, :, :n], slots, positions[:n],
                                                 key_pos))
            if fresh:
                parts.append(self._attend_prompts(i, q[:, :, n:], k[:, :, n:], v[:, :, n:], n, starts, sizes))
            del q, k, v
            h = lean.finish(i, h, torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])
        last = torch.arange(n, device=device)
        if fresh:
            computed = torch.tensor([m - a for a, m in zip(starts, sizes)], device=device)
            last = torch.cat([last, n + computed.cumsum(0) - 1])
            self._keep_prefix(fresh, n)
            for r in fresh:
                if self.temperature > 0:
                    r.generator = torch.Generator(device=device).manual_seed(r.seed)
        return self._pick(h[0, last], rows + fresh)

    # ---- the shared prompt prefix (a chat template's system prompt, a self-generation prefix) ------------
    def _reuse_prefix(self, row: _Row, slot: int) -> int:
        """Copy the cached shared prefix into ``slot`` when the prompt starts with it (and goes on after
        it); the number of prompt tokens that need no computing."""
        self._ensure_cache(len(row.prompt) + self.max_new_tokens + 1)
        p = len(self._prefix)
        if not p or len(row.prompt) <= p or row.prompt[:p] != self._prefix:
            return 0
        for layer in range(self.num_layers):
            self._cache.keys[layer][slot, :, :p] = self._prefix_kv[0][layer]
            self._cache.values[layer][slot, :, :p] = self._prefix_kv[1][layer]
        return p

    def _keep_prefix(self, fresh: list[_Row], first_slot: int) -> None:
        """After the first prefill of several prompts: keep the keys/values of the longest prefix that at
        least half of them share (a chat template's system prompt and user-turn opening)."""
        if self._prefix_kv is not None or len(fresh) < 2:
            return
        group, p = list(range(len(fresh))), 0
        while True:
            heads = Counter(fresh[j].prompt[p] for j in group if len(fresh[j].prompt) > p + 1)
            token, count = heads.most_common(1)[0] if heads else (None, 0)
            if count < max(2, len(fresh) // 2):
                break
            group = [j for j in group if len(fresh[j].prompt) > p + 1 and fresh[j].prompt[p] == token]
            p += 1
        slot = first_slot + group[0]
        self._prefix = fresh[group[0]].prompt[:p] if p >= _MIN_PREFIX else []
        self._prefix_kv = ([self._cache.keys[i][slot, :, :p].clone() for i in range(self.num_layers)],
                           [self._cache.values[i][slot, :, :p].clone() for i in range(self.num_layers)])

    def _attend_cached(self, i, q, k, v, slots, positions, key_pos) -> torch.Tensor:
        """Decode attention: row j's query (at positions[j]) over slot j's cache, its new key included.

        Rows differ in length (a chit-chat opening has ~40 tokens, a few have 600), and attention over a
        shared span costs every row the longest one. So all rows attend over the span that covers 7/8 of
        them, read in place; the few longer rows are then redone over their own span."""
        keys, values = self._cache.keys[i], self._cache.values[i]
        keys[slots, :, positions] = k[0].transpose(0, 1)
        values[slots, :, positions] = v[0].transpose(0, 1)
        n, kv_heads, d = q.shape[2], keys.shape[1], keys.shape[3]
        # grouped-query: the heads sharing a kv head become that head's query rows (no repeated keys)
        q = q[0].transpose(0, 1).reshape(n, kv_heads, -1, d)
        needed = positions + 1
        span = int(needed.kthvalue(max(1, (7 * n + 7) // 8)).values)
        out = self._attention(i, q, keys[:n, :, :span], values[:n, :, :span], positions, key_pos[:span])
        longer = (needed > span).nonzero(as_tuple=True)[0]
        if longer.numel():
            span = int(needed.max())
            out[longer] = self._attention(i, q[longer], keys[longer, :, :span], values[longer, :, :span],
                                          positions[longer], key_pos[:span])
        return out.reshape(1, n, -1)

    def _attention(self, i, q, keys, values, positions, key_pos) -> torch.Tensor:
        mask = key_pos[None, :] <= positions[:, None]  # [rows, span]
        window = self.lean.window(i)
        if window is not None:
            mask = mask & (positions[:, None] - key_pos[None, :] < window)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None, None],
                                              scale=self.lean.attention_scale(i))

    def _attend_prompts(self, i, q, k, v, first_slot: int, starts: list[int], sizes: list[int]) -> torch.Tensor:
        """New prompts: write their keys/values into their slots, then each prompt's computed tokens
        (from ``starts[j]`` on) attend causally over its slot (the reused prefix included)."""
        keys, values, out, offset = self._cache.keys[i], self._cache.values[i], [], 0
        window, scale = self.lean.window(i), self.lean.attention_scale(i)
        if not any(starts):  # no prefix reused: per-prompt causal attention over the new tokens alone
            for j, m in enumerate(sizes):
                keys[first_slot + j, :, :m] = k[0, :, offset : offset + m]
                values[first_slot + j, :, :m] = v[0, :, offset : offset + m]
                offset += m
            return segment_attention(q, k, v, sizes, scale, window)
        groups = q.shape[1] // keys.shape[1]
        for j, (a, m) in enumerate(zip(starts, sizes)):
            slot, c = first_slot + j, m - a
            keys[slot, :, a:m] = k[0, :, offset : offset + c]
            values[slot, :, a:m] = v[0, :, offset : offset + c]
            q_pos = torch.arange(a, m, device=q.device)[:, None]
            k_pos = torch.arange(m, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask = mask & (q_pos - k_pos < window)
            o = F.scaled_dot_product_attention(q[:, :, offset : offset + c],
                                               keys[slot : slot + 1, :, :m].repeat_interleave(groups, dim=1),
                                               values[slot : slot + 1, :, :m].repeat_interleave(groups, dim=1),
                                               attn_mask=mask, scale=scale)
            out.append(o.transpose(1, 2).reshape(1, c, -1))
            offset += c
        return torch.cat(out, dim=1)

    def _pick(self, h: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        """Next token per row from pre-final-norm states [n, H]: greedy, or sampled with each row's generator."""
        logits = self.head(self.lean.final_norm(h))  # float32 (targets.teacher.LogitHead)
        if self.temperature <= 0:
            return logits.argmax(-1).cpu()
        probs = torch.softmax(logits / self.temperature, dim=-1)
        if self.top_p < 1.0:
            probs = top_p_filter(probs, self.top_p)
        return sample_rows(probs, [r.generator for r in rows]).cpu()

    # ---- plumbing --------------------------------------------------------------------------------
    @property
    def _device(self) -> torch.device:
        return self.lean.embedding.weight.device

    def _ensure_cache(self, length: int) -> None:
        if self._cache is None:
            dtype = self.lean.embedding.weight.dtype
            c = self.lean.config
            kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
            head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
            self._cache = SlotCache(self.num_layers, self.slots, kv_heads, head_dim, length, dtype, self._device)
        self._cache.reserve(length)
