"""Fixed-slot KV cache of the embedded engine (owned by embedded/; model_runner.py drives it).

Each running request owns one slot. Per layer the cache holds one tensor of shape [S, *head_dims, L, D] for keys
and one for values (S slots, L the capacity in tokens, grown by doubling), plus, for DSA models, an indexer-key
tensor [S, L, D_idx]. A forward pass first calls `begin(slots, starts, q_len)`; transformers' attention layers then
call `update(...)`/`update_indexer(...)`, which write the new entries of each row at its own positions and return
the rows' caches gathered to [B, ..., kv_len, D] with kv_len = max(start + q_len). Rows shorter than kv_len are
padded with stale or zero entries that the caller's 4-D attention mask hides (see model_runner.build_mask).

The object duck-types the parts of transformers' `Cache` that the supported families call (`update`,
`update_indexer`, `get_seq_length`), so the models' own attention code runs unmodified.
"""

from __future__ import annotations

from typing import Any

import torch


class SlotKVCache:
    def __init__(self, num_slots: int, max_len: int, initial_len: int = 256) -> None:
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"num_slots={num_slots} and max_len={max_len} must be >= 1")
        self.num_slots = num_slots
        self.max_len = max_len
        self._cap = min(initial_len, max_len)
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}
        self._idx: dict[int, torch.Tensor] = {}
        self._free = list(range(num_slots - 1, -1, -1))
        self._rows = torch.zeros(0, dtype=torch.long)
        self._starts: list[int] = []
        self._q_len = 0

    # ---- slot bookkeeping -------------------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise RuntimeError("no free KV slot (the scheduler admits at most num_slots requests)")
        return self._free.pop()

    def release(self, slot: int) -> None:
        assert slot not in self._free, f"slot {slot} released twice"
        self._free.append(slot)

    def begin(self, slots: list[int], starts: list[int], q_len: int) -> int:
        """Declare the rows of the next forward: row b writes positions [starts[b], starts[b] + q_len) of slot
        slots[b]. Returns kv_len, the key length every row's attention sees."""
        end = max(starts) + q_len
        if end > self.max_len:
            raise ValueError(f"sequence of {end} tokens exceeds the engine's context length {self.max_len}")
        self._grow(end)
        self._rows = torch.tensor(slots, dtype=torch.long)
        self._starts = list(starts)
        self._q_len = q_len
        return end

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self._starts) if self._starts else 0

    # ---- called by the model's attention layers ---------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, kwargs: Any = None, **_: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states [B, Hk, q, Dk], value_states [B, Hv, q, Dv] -> cached [B, Hk, kv_len, Dk], [B, Hv, kv_len, Dv]."""
        if layer_idx not in self._k:
            self._k[layer_idx] = self._alloc_heads(key_states)
            self._v[layer_idx] = self._alloc_heads(value_states)
        k = self._write(self._k[layer_idx], key_states, seq_dim=2)
        v = self._write(self._v[layer_idx], value_states, seq_dim=2)
        return k, v

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """indexer keys [B, q, D] -> cached [B, kv_len, D] (DeepSeek sparse-attention indexer)."""
        if layer_idx not in self._idx:
            b, _, d = indexer_key_states.shape
            self._idx[layer_idx] = indexer_key_states.new_zeros(self.num_slots, self._cap, d)
        return self._write(self._idx[layer_idx], indexer_key_states, seq_dim=1)

    # ---- internals --------------------------------------------------------------------------------------------
    def _alloc_heads(self, states: torch.Tensor) -> torch.Tensor:
        _, h, _, d = states.shape
        return states.new_zeros(self.num_slots, h, self._cap, d)

    def _write(self, store: torch.Tensor, new: torch.Tensor, seq_dim: int) -> torch.Tensor:
        q = self._q_len
        assert new.shape[0] == len(self._starts) and new.shape[seq_dim] == q, "forward does not match begin()"
        if q == 1:  # decode: one position per row, each at its own index
            pos = torch.tensor(self._starts, dtype=torch.long)
            if seq_dim == 2:
                store[self._rows, :, pos] = new[:, :, 0]
            else:
                store[self._rows, pos] = new[:, 0]
        else:
            for b, (slot, start) in enumerate(zip(self._rows.tolist(), self._starts)):
                store[slot].narrow(seq_dim - 1, start, q).copy_(new[b])
        kv_len = max(self._starts) + q
        return store.index_select(0, self._rows).narrow(seq_dim, 0, kv_len)

    def _grow(self, needed: int) -> None:
        if needed <= self._cap:
            return
        new_cap = self._cap
        while new_cap < needed:
            new_cap = min(2 * new_cap, self.max_len)
        for store in (self._k, self._v):
            for layer, t in store.items():
                grown = t.new_zeros(*t.shape[:2], new_cap, t.shape[3])
                grown[:, :, : self._cap] = t
                store[layer] = grown
        for layer, t in self._idx.items():
            grown = t.new_zeros(t.shape[0], new_cap, t.shape[2])
            grown[:, : self._cap] = t
            self._idx[layer] = grown
        self._cap = new_cap
