"""The cache of a hybrid model (Qwen3.5): a KVCache for its full-attention layers and a RecurrentState for each
linear-attention layer, passed into the model like a KVCache and never hidden in it.

Policies:
- A KV prefix can be cut anywhere; a recurrent state only exists at the positions it was computed for. The
  cache therefore keeps snapshots of all recurrent states where its owner asks (`snapshot()`: the engine's
  prefill chunk boundaries), at most `max_snapshots`, newest kept; `truncate(n)` works where a
  state exists (0, the current length, or a snapshot) and raises otherwise. `reusable(n)` is the longest such
  position <= n, which the engine asks before it keeps a prefix.
- Speculative verification (a few drafted positions in one forward, most of them possibly rejected): while
  `keep_steps` is set, the model's linear layers run the verified positions token by token and leave the states
  after each one in `steps` (position -> states). The one-token recurrence is what plain decoding runs, so the
  verified tokens see the numbers decode would; keeping a fixed-size state per drafted position (a copy of each
  layer's delta state, ~1 MiB a layer at the 2B shape) costs less than running the accepted tokens again (a
  read of every weight). `truncate(n)` / `rollback(n)` then work at those positions too; the steps go when a
  forward runs without `keep_steps`, or on a cut (the state there is the current one).
- `copy_prefix(n)` / `load_prefix` move the keys and values of the first n positions together with the states
  at n and the snapshots before it, so an earlier sequence kept in the prefix store resumes exactly where it
  ended or where one of its prompts ended (`exact` entries: a store cuts them only there).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .kv_cache import KVCache


@dataclass
class RecurrentState:
    """One linear-attention layer's state: the conv inputs carried over and the delta-rule state per head."""
    conv: np.ndarray  # (K-1, conv_dim)
    ssm: np.ndarray  # (n_v_heads, dk, dv)

    def snapshot(self) -> "RecurrentState":
        return RecurrentState(self.conv.copy(), self.ssm.copy())

    def restore(self, other: "RecurrentState") -> None:
        self.conv[...] = other.conv
        self.ssm[...] = other.ssm

    def clear(self) -> None:
        self.conv.fill(0.0)
        self.ssm.fill(0.0)

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes


States = list[RecurrentState]


MTP_HIDDEN = -1  # the state key of the last position's final hidden state (what the MTP head reads next)


class HybridCache:
    """KV for the full-attention layers (`kv_slot[layer]`), recurrent states for the linear ones (`state[layer]`).
    With `mtp_hidden` (the MTP head drafts, qwen3_5_mtp.py): one more KV slot, for the head's attention layer
    (`kv_slot[mtp_layer]`, the layer after the last), and the last position's final hidden state (hidden,)
    kept as one more state (`state[MTP_HIDDEN].conv[0]`, zeros at a sequence start), so cuts, snapshots, steps
    and prefix copies carry the head's cache with the model's."""

    exact = True  # prefixes are whole sequences: kept only where a state exists

    def __init__(self, layer_types: tuple[str, ...], n_kv_heads: int, head_dim: int, max_len: int, dtype,
                 conv_shape: tuple[int, int], ssm_shape: tuple[int, int, int], max_snapshots: int = 4,
                 mtp_hidden: int = 0):
        full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        self.mtp_layer = len(layer_types) if mtp_hidden else None
        if self.mtp_layer is not None:
            full.append(self.mtp_layer)
        self.kv = KVCache(len(full), n_kv_heads, head_dim, max_len, dtype)
        self.kv_slot = {layer: j for j, layer in enumerate(full)}
        self.state = {i: RecurrentState(np.zeros(conv_shape, np.float32), np.zeros(ssm_shape, np.float32))
                      for i, t in enumerate(layer_types) if t != "full_attention"}
        if mtp_hidden:
            self.state[MTP_HIDDEN] = RecurrentState(np.zeros((1, mtp_hidden), np.float32), np.zeros((0, 0, 0), np.float32))
        self.max_snapshots = max_snapshots
        self.snapshots: dict[int, States] = {}  # position -> states of every linear layer there
        self.keep_steps = False  # set around a verify forward: the linear layers keep their state per position
        self.steps: dict[int, States] = {}  # position -> states there, from the forwards run with keep_steps
        self._pending: dict[int, list[RecurrentState]] = {}  # layer -> states after each position of this forward

    # ---- the KVCache surface the engine uses -------------------------------------------------------------
    @property
    def max_len(self) -> int:
        return self.kv.max_len

    @property
    def dtype(self):
        return self.kv.dtype

    @property
    def length(self) -> int:
        return self.kv.length

    @property
    def bytes_per_token(self) -> int:
        return self.kv.bytes_per_token

    @property
    def state_bytes(self) -> int:
        """The recurrent states of one position (what a snapshot costs)."""
        return sum(s.nbytes for s in self.state.values())

    def check_room(self, T: int) -> None:
        self.kv.check_room(T)

    def update(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.kv.update(self.kv_slot[layer], k, v)

    def commit(self, n: int) -> None:
        """n more positions are in the cache; with keep_steps, the states the layers left (keep_step) are kept
        at each of them, else earlier steps go (they belong to a sequence that has moved on)."""
        base = self.kv.length
        self.kv.commit(n)
        if not self.keep_steps:
            self.steps = {}
            return
        layers = list(self.state)
        if any(len(self._pending.get(i, ())) != n for i in layers):
            self._pending = {}
            raise ValueError("a forward with keep_steps did not keep every linear layer's state per position")
        for p in range(n):
            self.steps[base + p + 1] = [self._pending[i][p] for i in layers]
        self._pending = {}

    def keep_step(self, layer: int, states: list[RecurrentState]) -> None:
        """A linear layer's states after each position of the running forward (while keep_steps)."""
        self._pending[layer] = states

    def snapshot(self) -> None:
        """Keep the states at the current length (a later prompt that extends the sequence to here resumes)."""
        self.snapshots[self.length] = self._states()
        while len(self.snapshots) > self.max_snapshots:
            del self.snapshots[min(self.snapshots)]

    def reusable(self, n: int) -> int:
        """The longest position <= n this cache can be cut back to."""
        if n >= self.length:
            return self.length
        return max([p for p in (*self.snapshots, *self.steps) if p <= n], default=0)

    def truncate(self, n: int) -> None:
        n = max(0, min(self.length, n))
        if n == self.length:
            return
        if n == 0:
            self.reset()
            return
        self._load(self._state_at(n))
        self.snapshots = {p: s for p, s in self.snapshots.items() if p <= n}
        self.steps = {}
        self.kv.truncate(n)

    def rollback(self, n: int) -> None:
        """A verified run's rejected tail (KVCache.rollback): the same cut, at a step or snapshot position."""
        self.truncate(n)

    def states_at(self, n: int) -> States:
        """The states at position n (the length: a copy; else a kept snapshot or step, never written in place)."""
        return self._states() if n == self.length else self._state_at(n)

    def _state_at(self, n: int) -> States:
        if n in self.steps:
            return self.steps[n]
        if n in self.snapshots:
            return self.snapshots[n]
        raise ValueError(f"no recurrent state at position {n}")

    def reset(self) -> None:
        self.kv.reset()
        for s in self.state.values():
            s.clear()
        self.snapshots = {}
        self.steps = {}

    def copy_prefix(self, n: int) -> tuple[list[np.ndarray], list[np.ndarray], dict[int, States]]:
        """Keys/values of the first n positions and the states at n and at every snapshot before it (n: the
        length or a snapshot). Snapshots are never written in place, so the copy shares them."""
        n = min(n, self.length)
        states = {p: s for p, s in self.snapshots.items() if p < n}
        states[n] = self._states() if n == self.length else [s.snapshot() for s in self._state_at(n)]
        k, v = self.kv.copy_prefix(n)
        return k, v, states

    def load_prefix(self, k: list[np.ndarray], v: list[np.ndarray], n: int,
                    states: dict[int, States] | None = None) -> None:
        """Make copy_prefix's first n positions this cache's sequence (n: a position `states` holds)."""
        if states is None or n not in states:
            raise ValueError(f"no recurrent state at position {n} in the copied prefix")
        self.kv.load_prefix(k, v, n)
        self._load(states[n])
        self.snapshots = {p: s for p, s in states.items() if p <= n}
        self.steps = {}

    def _states(self) -> States:
        return [s.snapshot() for s in self.state.values()]

    def _load(self, states: States) -> None:
        for dst, src in zip(self.state.values(), states):
            dst.restore(src)
