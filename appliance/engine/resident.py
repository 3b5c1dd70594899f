"""Low-memory mode for dense models (`--max-resident MB`): the model file's mapped weight pages stay resident
under a budget, so a model file larger than free memory still runs, slower (the design article's layer
streaming; the mechanism is page_release's madvise, as `--moe-release-pages` uses it for experts).

Policies:
- What the budget counts: the resident pages of the model's file mappings (Rss of those mappings in
  /proc/self/smaps) plus the x8 rearranged copies of the pinned matrices. Streamed weights are read in place
  from the mapping (an x8 copy would be anonymous memory no release could reach); pinned ones get the x8 copy
  (full speed; their file pages are released once copied). Both layouts give the same products, so the
  greedy tokens are the same as without the budget.
- Plan: every token walks the layers in order, so a least-recently-used policy would evict each layer just
  before it is needed again. Instead the first layers (then the output head) stay resident after their first
  use ("pinned") while the pinned bytes plus the largest streamed unit fit the budget; each other layer's pages
  are released right after the layer ran. The output head of a streamed model runs in row slabs no larger than
  a layer, each released after its product; embedding rows are looked up and their pages released.
- Pages outside the weights (metadata, the tokenizer's strings in a GGUF) are released once at setup.
- Dense models only (qwen3/qwen2/llama): mixture-of-experts layers have `--moe-release-pages`.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np

from .page_release import is_file_mapped, release_pages, resident_bytes

_PAGE = mmap.PAGESIZE
_FAULT_AROUND = 64 << 10  # the kernel maps up to this much of cached neighbouring pages at each fault
_LINEARS = ("q", "k", "v", "o")
_MLP = ("gate", "up", "down")


class ResidentBudgetError(ValueError):
    """The budget cannot be kept for this model (too small, or a model kind it does not cover)."""


@dataclass(frozen=True)
class ResidentPlan:
    budget: int  # bytes
    pinned_layers: int  # layers 0..pinned_layers-1 stay resident after their first use
    head_pinned: bool  # the output head stays resident (only when every layer is pinned)
    head_slab_rows: int  # output head rows per product when it is streamed
    peak: int  # planned most resident bytes of the file mappings

    def describe(self, n_layers: int) -> str:
        head = "resident" if self.head_pinned else f"streamed in slabs of {self.head_slab_rows} rows"
        return (f"{self.pinned_layers} of {n_layers} layers resident, the rest streamed; output head {head}; "
                f"planned peak {self.peak / 2**20:.1f} MiB of {self.budget / 2**20:.1f} MiB")


def weight_array(w) -> np.ndarray | None:
    """The array a weight object reads (QuantWeight.raw, DenseWeight.w), if any."""
    for name in ("raw", "w"):
        a = getattr(w, name, None)
        if isinstance(a, np.ndarray):
            return a
    return None


def _mapped(arrays) -> list[np.ndarray]:
    return [a for a in arrays if a is not None and is_file_mapped(a)]


def _span(a: np.ndarray, fault_around: bool = True) -> int:
    """Most bytes of the mapping that using array a can make resident (page rounding and fault-around)."""
    return a.nbytes + 2 * (_FAULT_AROUND if fault_around else _PAGE)


def _mapping_base(a: np.ndarray | None):
    base: Any = a
    while base is not None and not isinstance(base, (np.memmap, mmap.mmap)):
        base = getattr(base, "base", None)
    while isinstance(outer := getattr(base, "base", None), np.memmap):  # the outermost memmap: the whole mapping
        base = outer
    return base


def plan_budget(layer_bytes: list[int], head_bytes: int, head_row_bytes: int, fixed: int,
                budget: int) -> ResidentPlan:
    """Pin the longest prefix of [layers..., head] that leaves room for the largest streamed unit."""
    n = len(layer_bytes)
    biggest_layer = max(layer_bytes, default=0)
    slab_rows = max(1, min(head_bytes, max(biggest_layer, 1 << 20)) // max(head_row_bytes, 1))
    slab = slab_rows * head_row_bytes + 2 * _FAULT_AROUND
    for k in range(n + 1, -1, -1):  # k: how many of [layers..., head] are pinned
        if k == n + 1:
            streaming = 0
        elif k == n:
            streaming = slab
        else:
            streaming = max(max(layer_bytes[k:]), slab)
        peak = fixed + sum(layer_bytes[:k]) + (head_bytes if k == n + 1 else 0) + streaming
        if peak <= budget:
            return ResidentPlan(budget, min(k, n), k == n + 1, slab_rows, peak)
    need = fixed + max(biggest_layer, slab)
    raise ResidentBudgetError(f"a budget of {budget / 2**20:.0f} MiB is below what one layer needs "
                              f"({need / 2**20:.0f} MiB at least)")


class StreamedHead:
    """An output head (out, in) run in row slabs; each slab's pages are released after its product.
    rows() (the tied embedding lookup) releases the looked-up pages too."""

    def __init__(self, w, slab_rows: int):
        self.w, self.shape = w, w.shape
        self.slabs = [(r, min(r + slab_rows, w.shape[0]), _row_slice(w, r, min(r + slab_rows, w.shape[0])))
                      for r in range(0, w.shape[0], slab_rows)]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        out = np.empty((x.shape[0], self.shape[0]), np.float32)  # (T, out)
        for r0, r1, slab in self.slabs:
            out[:, r0:r1] = slab(x)
            release_pages(weight_array(slab))
        return out

    def rows(self, ids: np.ndarray) -> np.ndarray:
        out = self.w.rows(ids)  # (T, in)
        release_pages(weight_array(self.w))
        return out


def _row_slice(w, r0: int, r1: int):
    from .quant_weights import QuantWeight
    from .weights import DenseWeight
    if isinstance(w, QuantWeight):
        return QuantWeight(w.qtype, (r1 - r0, w.shape[1]), w.raw[r0:r1], native=w.native, repack=False)
    if isinstance(w, DenseWeight):
        return DenseWeight(w.w[r0:r1])
    raise ResidentBudgetError(f"cannot stream an output head of type {type(w).__name__}")


class LayerStreaming:
    """Set on a dense Qwen3Model as `model.layer_streaming`; qwen3.forward_hidden (and the native decoder)
    call layer_done(i) after layer i ran."""

    def __init__(self, model, budget: int):
        from .quant_weights import QuantWeight

        if getattr(model, "multimodal", False) or not hasattr(model, "layers"):
            raise ResidentBudgetError("only dense text models (qwen3, qwen2, llama) are supported")
        self.layer_arrays: list[list[np.ndarray]] = []
        vectors: list[np.ndarray] = []
        for layer in model.layers:
            mlp = layer.mlp
            if type(mlp).__name__ != "SwiGLU":
                raise ResidentBudgetError("only dense models are supported (mixture-of-experts models: "
                                          "--moe-release-pages)")
            weights = [getattr(layer.attn, n) for n in _LINEARS] + [getattr(mlp, n) for n in _MLP]
            self.layer_arrays.append(_mapped(weight_array(w) for w in weights))
            vectors += _mapped([layer.attn_norm, layer.mlp_norm, layer.attn.q_norm, layer.attn.k_norm,
                                layer.attn.q_bias, layer.attn.k_bias, layer.attn.v_bias])
        head = model.lm_head
        head_array = weight_array(head)
        head_mapped = head_array is not None and is_file_mapped(head_array)
        head_bytes = head_array.nbytes if head_mapped and head_array is not None else 0
        row_bytes = head_bytes // head.shape[0] if head_mapped else 1
        fixed = sum(_span(v, False) for v in vectors) + (2 << 20)  # norms, embedding rows of a prompt, slack
        layer_bytes = [sum(_span(a) for a in arrays) for arrays in self.layer_arrays]
        self.plan = plan_budget(layer_bytes, head_bytes, row_bytes, fixed, budget)  # may refuse: nothing changed yet
        pinned = [w for l in model.layers[:self.plan.pinned_layers] for w in (
            *(getattr(l.attn, n) for n in _LINEARS), *(getattr(l.mlp, n) for n in _MLP))]
        if self.plan.head_pinned:
            pinned.append(head)
        keep = {id(w) for w in pinned}
        for w in {id(x): x for x in [model.embed, head] + [w for l in model.layers for w in (
                *(getattr(l.attn, n) for n in _LINEARS), *(getattr(l.mlp, n) for n in _MLP))]}.values():
            if isinstance(w, QuantWeight) and id(w) not in keep:  # streamed: read in place, no x8 copy
                w.repack, w._x8, w._native_matmul = False, None, None
        # pinned matrices keep (or make, at their first product) the x8 copy: resident as anonymous memory
        # instead of file pages (same size, counted by resident_bytes), at full speed
        self.copies = [w for w in pinned if isinstance(w, QuantWeight)]
        emb = weight_array(model.embed)
        if emb is not None and is_file_mapped(emb):  # rows are looked up, then their pages released
            model.embed = StreamedHead(model.embed, self.plan.head_slab_rows)
        if head_mapped and not self.plan.head_pinned:
            model.lm_head = StreamedHead(head, self.plan.head_slab_rows)
        if model.runner is not None:  # a native runner chosen before would read the x8 copies: choose again
            from .layer_runner import choose_runner
            choose_runner(model)
        self.mappings = {id(b): b for b in (_mapping_base(a) for arrays in self.layer_arrays for a in arrays)
                         if b is not None}
        if head_mapped:
            b = _mapping_base(head_array)
            self.mappings.setdefault(id(b), b)
        self.mapping_views = [np.frombuffer(b, np.uint8) if isinstance(b, mmap.mmap) else b.view(np.ndarray)
                              for b in self.mappings.values()]
        for v in self.mapping_views:  # metadata, tokenizer strings, pages touched at load: start from nothing
            release_pages(v)

    def resident_bytes(self) -> int:
        """Resident weight bytes now: the model's file mappings (/proc/self/pagemap) plus the pinned matrices'
        x8 copies; -1 where /proc is not available."""
        counts = [resident_bytes(v) for v in self.mapping_views]
        copies = sum(w._x8.nbytes for w in self.copies if w._x8 is not None)
        return -1 if -1 in counts else sum(counts) + copies

    def layer_done(self, i: int) -> None:
        if i >= self.plan.pinned_layers:
            for a in self.layer_arrays[i]:
                release_pages(a)


def set_max_resident(model, budget_bytes: int) -> ResidentPlan:
    """Keep `model`'s mapped weights under budget_bytes resident (see the module policy); returns the plan."""
    streaming = LayerStreaming(model, budget_bytes)
    model.layer_streaming = streaming
    return streaming.plan
