"""Layouts: how the rows an encoder computes on relate to the caller's padded (B, T) batch.

One protocol, three layouts, chosen per batch by EncoderBody.plan:
- `Padded`: the rows are the batch itself, (B, T, C); attention masks padded keys. Also the layout of a batch with
  nothing padded (no mask at all: SDPA's unmasked fast path).
- `Packed` (padding-free, the default): only the N real tokens, (N, C). Embeddings, projections, feed-forwards and
  LayerNorms run on N rows, attention per sequence over its own tokens (sum of L_i^2 scores instead of B * T^2).
  Real text under dynamic padding is 40-60% padding, which transformers computes and hfport does not.
- `RepresentativePadding`: the real tokens plus one padded row per sequence, for families whose padded path must
  reproduce transformers' values at padding positions under a pair mask (DeBERTa: a pair attends only if both
  tokens are real, so a padded query attends uniformly to every key).

Everything per token is layout-blind; a layout owns the three things that are not: getting the embeddings into its
rows (`embed`), moving tensors between its rows and (B, T, ...) (`pack`, `unpack`), and attention (`attend`: split
heads, run the kernel over whole sequences with the layout's mask, the family's bias callback and an optional
sliding window, merge heads). `positions` holds each row's position id, for rotary embeddings and windows.
Two attention helpers sit beside this file: nn/band.py (a sliding window's band, run blocked on long sequences) and
nn/groups.py (Packed's short runs regrouped by length into a few padded calls, and the cost rule that decides).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property, partial
from itertools import accumulate
from typing import Any, Callable, Protocol

import torch
from torch import Tensor, nn

from .band import BandPlan, Kernel, attend_local, banded, window_band
from .groups import CUDA_CALL_COST, CUDA_SCATTER_COST, Groups, plan_groups
from .varlen import (BoundKernel, cu_seqlens, cuda_route, fallback_reason, say_once, varlen_dropout, varlen_kernel,
                     window_size)

# bias(q, k) -> the additive score bias (G|1, H|1, L, L) of G sequences of length L given their (G, H, L, D) queries
# and keys (DeBERTa's relative terms), or None. The one injection point for score terms, on every layout. It returns
# a fresh tensor: a layout may write its mask into it in place.
SequenceBias = Callable[[Tensor, Tensor], "Tensor | None"]


class Layout(Protocol):
    keep: Tensor | None  # (B, T) bool real tokens; None when nothing is padded
    positions: Tensor  # the position id of every row, shaped like the rows without C: (B|1, T) or (N,)
    # a mixed-adapter batch's routing bound to this layout (nn/lora.py's Route: which adapter each row takes), which
    # every linear call of the blocks passes on (nn/lora.py's `routed`); None: every row the plain layers
    adapters: Any

    @property
    def max_length(self) -> int: ...  # the longest sequence attention sees (relative tables are built for it)

    def embed(self, embeddings: nn.Module, input_ids: Tensor, token_type_ids: Tensor | None) -> Tensor: ...

    def pack(self, x: Tensor) -> Tensor: ...  # (B, T, F) -> rows

    def unpack(self, x: Tensor) -> Tensor: ...  # rows -> (B, T, F)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, heads: int, kernel: Kernel, bias: SequenceBias | None,
               window: int | None) -> Tensor: ...  # rows (.., C) each -> rows (.., C)

    def cached(self, key: Any, build: Callable[[], Any]) -> Any: ...


class _PerBatch:
    def cached(self, key: Any, build: Callable[[], Any]) -> Any:
        """A value derived from this batch's layout (a window mask, rotary tables), built once and shared by every
        layer: a layout lives for one forward pass."""
        memo = self.__dict__.setdefault("_memo", {})
        if key not in memo:
            memo[key] = build()
        return memo[key]


def padding_mask(attention_mask: Tensor | None) -> Tensor | None:
    """(B, T) 1/0 mask -> boolean key mask (B, 1, 1, T), or None when nothing is padded."""
    if attention_mask is None:
        return None
    mask = attention_mask.bool()
    if bool(mask.all()):
        return None  # lets SDPA take its unmasked fast path
    return mask[:, None, None, :]


def _heads(x: Tensor, heads: int) -> Tensor:
    b, t, c = x.shape
    return x.view(b, t, heads, c // heads).transpose(1, 2)  # (B, H, T, D)


def _merge_heads(x: Tensor) -> Tensor:
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)  # (B, T, C)


@dataclass(frozen=True, eq=False)
class Padded(_PerBatch):
    """The batch as it came: rows (B, T, C), padded keys masked. Padded query rows attend to the real keys, as in
    transformers' BERT-like families, so the values at padding positions match theirs too."""

    keep: Tensor | None  # (B, T) bool, or None when nothing is padded
    positions: Tensor  # (B|1, T) long
    adapters: Any = None  # Layout.adapters

    @staticmethod
    def from_mask(attention_mask: Tensor | None, positions: Tensor) -> Padded:
        mask = padding_mask(attention_mask)
        return Padded(None if mask is None else mask[:, 0, 0, :], positions)

    @property
    def max_length(self) -> int:
        return self.positions.shape[-1]

    @cached_property
    def key_mask(self) -> Tensor | None:
        return None if self.keep is None else self.keep[:, None, None, :]  # (B, 1, 1, T)

    def embed(self, embeddings: nn.Module, input_ids: Tensor, token_type_ids: Tensor | None) -> Tensor:
        return embeddings(input_ids, token_type_ids, self.positions, adapters=self.adapters)  # (B, T, C)

    def pack(self, x: Tensor) -> Tensor:
        return x

    def unpack(self, x: Tensor) -> Tensor:
        return x

    def attend(self, q: Tensor, k: Tensor, v: Tensor, heads: int, kernel: Kernel, bias: SequenceBias | None,
               window: int | None) -> Tensor:
        """q, k, v: (B, T, C) -> (B, T, C): one kernel call over the whole batch."""
        q, k, v = _heads(q, heads), _heads(k, heads), _heads(v, heads)  # (B, H, T, D)
        mask = self.key_mask  # (B, 1, 1, T) | None
        if bias is None and self.keep is None and banded(q.shape[2], window):  # nothing padded: blocked band
            plan = self.cached(("band", window), lambda: BandPlan.build(
                self.positions.expand(q.shape[0], -1), None, window))
            return _merge_heads(plan.attend(q, k, v, kernel))  # (B, T, C)
        if window is not None:
            mask = self.cached(("window", window), lambda: self._window_mask(window))  # (B|1, 1, T, T) | None
        out = kernel(q, k, v, mask=mask, bias=bias(q, k) if bias is not None else None)  # (B, H, T, D)
        return _merge_heads(out)  # (B, T, C)

    def _window_mask(self, window: int) -> Tensor | None:
        band = window_band(self.positions, window)[:, None]  # (B|1, 1, T, T)
        if self.key_mask is not None:
            band = band & self.key_mask  # (B, 1, T, T)
        return None if bool(band.all()) else band


@dataclass(frozen=True, eq=False)
class Packed(_PerBatch):
    """Padding-free: only the real tokens, rows (N, C), packed sequence by sequence in their order within the
    sequence, so sequence i owns rows [starts[i], starts[i] + lengths[i]). Unpacking puts zeros at padding."""

    keep: Tensor  # (B, T) bool: real tokens
    index: Tensor  # (N,) long: flat position b * T + t of each real token
    lengths: tuple[int, ...]  # real tokens per sequence
    contiguous: bool  # every sequence's real tokens form one run (left or right padding, no holes)
    positions: Tensor  # (N,) long: each row's position id
    host_positions: Tensor  # (N,) long on the host: `positions` where attention is planned (the same tensor on CPU)
    adapters: Any = None  # Layout.adapters

    @staticmethod
    def from_mask(attention_mask: Tensor, positions: Tensor | None = None) -> Packed | None:
        """None when nothing is padded: the plain (B, T) path is then as fast and needs no gathering.

        positions: the padded batch's position ids (B|1, T), packed with the tokens; by default each token's
        position in the padded row, which restarts at 0 for every right-padded sequence (and is shifted by the
        padding for left-padded ones: rotary scores depend on position differences only).

        A batch on a GPU is planned on the host (see on_host): the row counts are Python values either way."""
        if attention_mask.device.type != "cpu":
            return Packed.on_host(attention_mask, positions)
        keep = attention_mask.bool()  # (B, T)
        if bool(keep.all()):
            return None
        b, t = keep.shape
        index = keep.reshape(-1).nonzero().squeeze(1)  # (N,)
        lengths = keep.sum(dim=1)  # (B,)
        first = keep.int().argmax(dim=1)  # (B,): first real token
        span = torch.arange(t, device=keep.device)[None, :]  # (1, T)
        run = (span >= first[:, None]) & (span < (first + lengths)[:, None])  # (B, T)
        if positions is None:
            positions = span
        packed_positions = positions.expand(b, t).reshape(-1).index_select(0, index)  # (N,)
        return Packed(keep, index, tuple(lengths.tolist()), bool((run == keep).all()), packed_positions,
                      packed_positions)

    @staticmethod
    def on_host(attention_mask: Tensor, positions: Tensor | None) -> Packed | None:
        """A device batch's layout: its mask and position ids read back in one copy (the forward pass's one wait
        for the GPU: how many rows each sequence has is a Python value, here and in transformers' padding-free
        path alike), planned on the host as a CPU batch is, and the rows' index and positions sent back without
        waiting (non_blocking). Every later plan (cu_seqlens, groups, masks) reads the host copies."""
        b, t = attention_mask.shape
        if positions is None:
            positions = torch.arange(t, device=attention_mask.device)[None, :]  # (1, T)
        both = torch.stack((attention_mask.to(torch.long), positions.to(torch.long).expand(b, t))).cpu()  # (2, B, T)
        host = Packed.from_mask(both[0], both[1])
        if host is None:
            return None
        device = attention_mask.device
        return dataclasses.replace(host, keep=attention_mask.bool(), index=host.index.to(device, non_blocking=True),
                                   positions=host.positions.to(device, non_blocking=True))

    @property
    def batch(self) -> int:
        return self.keep.shape[0]

    @property
    def width(self) -> int:
        return self.keep.shape[1]

    @cached_property
    def starts(self) -> tuple[int, ...]:
        return tuple(accumulate(self.lengths, initial=0))[:-1]

    @cached_property
    def runs(self) -> tuple[tuple[int, int, int], ...]:
        """(first packed row, number of sequences, length) of each run of consecutive equal-length sequences:
        one attention call serves a whole run (length-sorted batches, e.g. predict's, have long runs)."""
        out: list[tuple[int, int, int]] = []
        for start, n in zip(self.starts, self.lengths):
            if not n:
                continue
            if out and out[-1][2] == n:
                first, count, _ = out[-1]
                out[-1] = (first, count + 1, n)
            else:
                out.append((start, 1, n))
        return tuple(out)

    @property
    def max_length(self) -> int:
        return max(self.lengths)

    @cached_property
    def rows_in_order(self) -> bool:
        """Each sequence's position ids step by one from row to row (no hole in the mask, ordinary position ids):
        a window counted in rows (varlen_attn's) is then the window counted in position ids (hfport's)."""
        if not self.contiguous:
            return False
        steps = self.host_positions.diff()  # (N - 1,)
        starts = torch.tensor([s for s, n in zip(self.starts, self.lengths) if n][1:], dtype=torch.long) - 1
        inside = torch.ones_like(steps, dtype=torch.bool).index_fill_(0, starts, False)  # steps within a sequence
        return bool((steps[inside] == 1).all())

    def device_tensor(self, key: str, build: Callable[[], Tensor], device: torch.device) -> Tensor:
        """A host-built planning tensor on the rows' device, copied once per batch without waiting."""
        return self.cached((key, device), lambda: build().to(device, non_blocking=True))

    def embed(self, embeddings: nn.Module, input_ids: Tensor, token_type_ids: Tensor | None) -> Tensor:
        """The embeddings of the real tokens only: ids, token types and positions packed first."""
        token_type_ids = self.pack(token_type_ids)[None] if token_type_ids is not None else None  # (1, N)
        return embeddings(self.pack(input_ids)[None], token_type_ids, self.positions[None],
                          adapters=self.adapters)[0]  # (N, C)

    def pack(self, x: Tensor) -> Tensor:
        """(B, T, ...) -> (N, ...). Integer tensors (ids) are gathered directly; float ones keep a fast gradient."""
        flat = x.reshape(self.batch * self.width, *x.shape[2:])  # (B * T, ...)
        if not flat.is_floating_point() or flat.dim() != 2:
            return flat.index_select(0, self.index)
        return Rows.apply(flat, self.index, True)

    def unpack(self, x: Tensor) -> Tensor:
        """(N, F) -> (B, T, F), zeros at padding positions."""
        return _Scatter.apply(x, self.index, self.batch * self.width).view(self.batch, self.width, x.shape[-1])

    def attend(self, q: Tensor, k: Tensor, v: Tensor, heads: int, kernel: Kernel, bias: SequenceBias | None,
               window: int | None) -> Tensor:
        """q, k, v: (N, C) packed rows -> (N, C): each sequence attends over its own L_i tokens only.

        One kernel call per run of equal-length sequences (often one per sequence); the per-call overhead is
        small next to the B * T^2 - sum(L_i^2) score entries a masked padded call computes and throws away. Without
        a bias callback, a batch of many short runs takes a few padded calls instead, its sequences grouped by
        length (the cost rule at CALL_COST, nn/groups.py's plan_groups), and sequences of >= BANDED_MIN_WINDOWS
        windows run local attention blocked (BandPlan).
        Measured on a 2-core CPU, 16 rows with 41% padding, attention forward + backward with dropout / without:
        per sequence 156 / 105 ms, one masked padded call 380 / 126 ms, nested-tensor SDPA 672 / 700 ms.
        A sliding window is a band mask per run, built here on any device.

        On CUDA (SelfAttention's kernel, nn/varlen.py's BoundKernel): no per-run loop. One varlen_attn call over
        every sequence (cu_seqlens and the longest length built on the host; a window as window_size; attention
        dropout through varlen_dropout), or, where cuda_route says it cannot run (no such kernel in this torch, a
        score bias, fp32), padded
        SDPA over a few length groups, the bias callback called per group (see attend_cuda)."""
        if q.is_cuda and isinstance(kernel, BoundKernel):
            return self.attend_cuda(q, k, v, heads, kernel, bias, window)
        c = q.shape[1]
        d = c // heads
        groups = self.cached(("groups", c), lambda: plan_groups(self, c)) if bias is None else None
        if groups is not None:
            return self._attend_grouped(q, k, v, heads, kernel, window, groups)
        masks = self.cached(("window", window), lambda: self._window_masks(window)) if window is not None else None
        pieces = []
        # split, not slicing: a slice's backward writes a zero (N, C) gradient per run, quadratic in runs
        sizes = [count * length for _, count, length in self.runs]
        for r, ((_, count, length), qr, kr, vr) in enumerate(zip(self.runs, *(x.split(sizes) for x in (q, k, v)))):
            qi, ki, vi = (x.view(count, length, heads, d).transpose(1, 2) for x in (qr, kr, vr))  # (G, H, L, D)
            if bias is None:
                out = attend_local(qi, ki, vi, kernel, masks[r] if masks is not None else None)  # (G, H, L, D)
            else:
                out = kernel(qi, ki, vi, mask=masks[r] if masks is not None else None, bias=bias(qi, ki))
            pieces.append(out.transpose(1, 2).reshape(count * length, c))  # (G * L, C)
        return torch.cat(pieces)  # (N, C)

    def _attend_grouped(self, q: Tensor, k: Tensor, v: Tensor, heads: int, kernel: Kernel, window: int | None,
                        groups: Groups, masks: list[Tensor | BandPlan | None] | None = None,
                        bias: SequenceBias | None = None) -> Tensor:
        """q, k, v (N, C) -> (N, C): the rows scattered into the groups' padded buffer (S = sum G * L rows), one
        kernel call per group over (G, H, L, D) with real keys only, rows gathered back. Padded query rows attend
        to every key (thrown away; a fully masked row would be NaN and poison the backward). bias: the score bias of
        a group's length L, (G|1, H|1, L, L) (relative terms depend on distances only, so a sequence padded to L
        reads its own); masks: the groups' (default: built from them here)."""
        c = q.shape[1]
        if masks is None:
            masks = self.cached(("group masks", window), lambda: groups.masks(window))
        sizes = [count * length for count, length in groups.shapes]
        buffers = (_Scatter.apply(x, groups.slots, groups.size).split(sizes) for x in (q, k, v))  # (G * L, C) each
        pieces = []
        for (count, length), mask, qg, kg, vg in zip(groups.shapes, masks, *buffers):
            qh, kh, vh = (_heads(x.view(count, length, c), heads) for x in (qg, kg, vg))  # (G, H, L, D)
            if bias is None:
                out = attend_local(qh, kh, vh, kernel, mask)  # (G, H, L, D)
            elif isinstance(mask, BandPlan):
                raise ValueError("a score bias with blocked local attention: no family has both")
            else:
                out = kernel(qh, kh, vh, mask=mask, bias=bias(qh, kh))  # (G, H, L, D)
            pieces.append(_merge_heads(out).reshape(count * length, c))  # (G * L, C)
        return Rows.apply(torch.cat(pieces) if len(pieces) > 1 else pieces[0], groups.slots, True)  # (N, C)

    # --- CUDA: no per-run loop --------------------------------------------------------------------------------

    def attend_cuda(self, q: Tensor, k: Tensor, v: Tensor, heads: int, kernel: BoundKernel,
                    bias: SequenceBias | None, window: int | None, varlen: Callable[..., Tensor] | None = None
                    ) -> Tensor:
        """q, k, v (N, C) -> (N, C) on a GPU: cuda_route picks one varlen_attn call (attend_varlen) or padded SDPA
        over length groups (attend_groups). `varlen`: the kernel (default VARLEN_ATTN, or varlen_dropout while
        attention dropout is on); tests pass varlen_reference to run this branch's arithmetic on the CPU."""
        plain = varlen_kernel() if varlen is None else varlen  # None: this torch has no varlen_attn
        d = q.shape[1] // heads
        route = cuda_route(q.dtype, d, bias=bias is not None, rows_in_order=window is None or self.rows_in_order,
                           varlen=plain is not None)
        if route == "varlen":
            if kernel.dropout_p > 0:  # training: the same kernel with its dropout
                plain = partial(varlen_dropout if varlen is None else varlen, dropout_p=kernel.dropout_p)
            return self.attend_varlen(q, k, v, heads, kernel.scale, window, plain)
        say_once(fallback_reason(q.dtype, d, bias=bias is not None))
        return self.attend_groups(q, k, v, heads, kernel, bias, window)

    def attend_varlen(self, q: Tensor, k: Tensor, v: Tensor, heads: int, scale: float, window: int | None,
                      varlen: Callable[..., Tensor]) -> Tensor:
        """q, k, v (N, C) -> (N, C): every sequence in one varlen(q, k, v, cu_seqlens, cu_seqlens, longest,
        longest, scale=, window_size=) call over (N, H, D) views; cu_seqlens and the longest length come from the
        host plan (nothing read back from the GPU)."""
        n, c = q.shape
        cu = self.device_tensor("cu_seqlens", lambda: cu_seqlens(self.lengths), q.device)  # (B' + 1,) int32
        longest = self.max_length
        out = varlen(*(x.view(n, heads, c // heads) for x in (q, k, v)), cu, cu, longest, longest,
                     scale=scale, window_size=window_size(window))  # (N, H, D)
        return out.reshape(n, c)  # (N, C)

    def attend_groups(self, q: Tensor, k: Tensor, v: Tensor, heads: int, kernel: Kernel,
                      bias: SequenceBias | None, window: int | None) -> Tensor:
        """q, k, v (N, C) -> (N, C): padded SDPA over length groups, the groups and their masks planned on the host
        (nn/groups.py's rule at its CUDA costs, always grouped) and copied to the rows' device once per batch."""
        c = q.shape[1]
        host = self.cached(("host groups", c), lambda: plan_groups(_HostRows(self), c, call_cost=CUDA_CALL_COST,
                                                                     scatter_cost=CUDA_SCATTER_COST, per_run=False))
        groups = self.cached(("groups on", q.device, c), lambda: host.to(q.device))
        masks = self.cached(("group masks on", q.device, c, window), lambda: [
            m.to(q.device, non_blocking=True) if m is not None else None for m in host.masks(window)])
        return self._attend_grouped(q, k, v, heads, kernel, window, groups, masks, bias)

    def _window_masks(self, window: int) -> list[Tensor | BandPlan | None]:
        """Per run (G, 1, L, L) band masks (a BandPlan for long runs), None for a run the window covers whole."""
        masks: list[Tensor | BandPlan | None] = []
        for start, count, length in self.runs:
            positions = self.positions[start: start + count * length].view(count, length)  # (G, L)
            if banded(length, window):
                masks.append(BandPlan.build(positions, None, window))
                continue
            band = window_band(positions, window)  # (G, L, L)
            masks.append(None if bool(band.all()) else band[:, None])  # (G, 1, L, L)
        return masks


@dataclass(frozen=True, eq=False)
class _HostRows:
    """A packed batch as its host plan sees it (PackedRows, nn/groups.py): its position ids on the host, so groups
    and masks are built there and copied to the GPU, never read back from it."""

    packed: Packed

    @property
    def lengths(self) -> tuple[int, ...]:
        return self.packed.lengths

    @property
    def positions(self) -> Tensor:
        return self.packed.host_positions

    @property
    def batch(self) -> int:
        return self.packed.batch

    @property
    def starts(self) -> tuple[int, ...]:
        return self.packed.starts

    @property
    def runs(self) -> tuple[tuple[int, int, int], ...]:
        return self.packed.runs


@dataclass(frozen=True, eq=False)
class RepresentativePadding(_PerBatch):
    """The padded path of a family masking (query, key) pairs unless both are real (DeBERTa): rows are the real
    tokens plus one representative padded row per sequence, (N', C).

    Masks: a padded query row is fully masked in transformers and so attends uniformly to every key. hfport gives
    the same values without a row of dtype minimums, whose log-sum-exp SDPA's backward cannot represent: a padded
    row's query is zeroed and its bias set to 0, which is uniform too, and its scores pass no gradient back.

    Packing: every padded position of a sequence holds the same value at every layer (zero embeddings, the same
    uniform attention, the same residual), so the per-token work runs on the real tokens plus one representative
    per sequence, and attention unpacks to (B, T). Values at padding positions are transformers' too."""

    keep: Tensor  # (B, T) bool
    positions: Tensor  # (N',) long
    padded_positions: Tensor  # (B|1, T) long: the batch's position ids, for the embeddings
    padded_rows: Tensor  # (B, 1, T, 1) bool
    padded_keys: Tensor  # (B, 1, 1, T) bool
    rows: Tensor  # (N',) long: flat (B * T) position of each packed row
    scatter: Tensor  # (B * T,) long: packed row of each flat position
    adapters: Any = None  # Layout.adapters

    @staticmethod
    def from_mask(attention_mask: Tensor | None, positions: Tensor) -> RepresentativePadding | Padded:
        """The plain Padded layout when nothing is padded."""
        mask = padding_mask(attention_mask)
        if mask is None:
            return Padded(None, positions)
        keep = mask[:, 0, 0, :]  # (B, T)
        b, t = keep.shape
        padded_rows = ~keep[:, None, :, None]  # (B, 1, T, 1)
        # cumsum of long, not bool: ONNX's CumSum takes no bool (the ONNX export traces this layout)
        first_pad = ~keep & (torch.cumsum((~keep).long(), dim=1) == 1)  # (B, T): each sequence's representative
        chosen = keep | first_pad  # (B, T)
        packed_id = torch.cumsum(chosen.reshape(-1).long(), dim=0) - 1  # (B * T,)
        rep_id = (packed_id.view(b, t) * first_pad).sum(dim=1, keepdim=True)  # (B, 1)
        scatter = torch.where(keep, packed_id.view(b, t), rep_id).reshape(-1)  # (B * T,)
        rows = chosen.reshape(-1).nonzero().squeeze(1)  # (N',)
        row_positions = positions.expand(b, t).reshape(-1).index_select(0, rows)  # (N',)
        return RepresentativePadding(keep, row_positions, positions, padded_rows, ~keep[:, None, None, :], rows,
                                     scatter)

    @property
    def max_length(self) -> int:
        return self.keep.shape[1]

    def embed(self, embeddings: nn.Module, input_ids: Tensor, token_type_ids: Tensor | None) -> Tensor:
        """Embeddings of the padded batch with padding zeroed (the precondition of sharing one representative;
        transformers' DeBERTa zeroes them too), then packed."""
        x = embeddings(input_ids, token_type_ids, self.padded_positions, adapters=self.adapters)  # (B, T, C)
        return self.pack(x * self.keep[..., None])  # (N', C)

    def pack(self, x: Tensor) -> Tensor:  # (B, T, F) -> (N', F)
        return Rows.apply(x.reshape(-1, x.shape[-1]), self.rows, True)

    def unpack(self, x: Tensor) -> Tensor:  # (N', F) -> (B, T, F)
        return Rows.apply(x, self.scatter, False).view(self.keep.shape[0], -1, x.shape[-1])

    def attend(self, q: Tensor, k: Tensor, v: Tensor, heads: int, kernel: Kernel, bias: SequenceBias | None,
               window: int | None) -> Tensor:
        """q, k, v: (N', C) -> (N', C): one kernel call over the unpacked (B, T) batch, pairs masked by bias."""
        q, k, v = (_heads(self.unpack(x), heads) for x in (q, k, v))  # (B, H, T, D)
        q = q.masked_fill(self.padded_rows, 0.0)  # padded query rows: uniform attention, no score gradient
        override, fill = self.cached(("pairs", q.dtype, window), lambda: self._pairs(q.dtype, window))
        scores_bias = bias(q, k) if bias is not None else None  # (B|1, H|1, T, T) | None
        if scores_bias is None:
            scores_bias = fill  # (B, 1, T, T)
        else:  # replaced, so masked pairs pass no gradient back (as transformers' masked_fill)
            if scores_bias.shape[0] != fill.shape[0]:  # a bias shared by the batch: one copy per sequence
                scores_bias = scores_bias.expand(fill.shape[0], *scores_bias.shape[1:]).contiguous()
            scores_bias = scores_bias.masked_fill_(override, 0.0).add_(fill)  # (B, H, T, T)
        out = kernel(q, k, v, mask=None, bias=scores_bias)  # (B, H, T, D)
        return self.pack(_merge_heads(out))  # (N', C)

    def _pairs(self, dtype: torch.dtype, window: int | None) -> tuple[Tensor, Tensor]:
        """override (B, 1, T, T) bool: pairs whose score is replaced by fill (B, 1, T, T): 0 on padded rows, the
        dtype's minimum at a real row's padded keys (and, with a window, at its keys outside the window)."""
        b, t = self.keep.shape
        masked = self.padded_keys & ~self.padded_rows  # (B, 1, T, T)
        if window is not None:  # padded rows stay uniform over every key
            masked = masked | (~window_band(self.padded_positions, window)[:, None] & ~self.padded_rows)
        fill = torch.zeros(b, 1, t, t, dtype=dtype, device=self.keep.device)
        fill.masked_fill_(masked, torch.finfo(dtype).min)
        return self.padded_rows | masked, fill


class Rows(torch.autograd.Function):
    """x.index_select(0, rows) with a faster gradient: index_copy_ when the rows are distinct (packing), which on
    CPU is several times faster than index_select's generic scatter-add backward; index_add_ when rows repeat."""

    @staticmethod
    def forward(ctx, x: Tensor, rows: Tensor, distinct: bool) -> Tensor:  # (M, F) -> (N, F)
        ctx.save_for_backward(rows)
        ctx.m, ctx.distinct = x.shape[0], distinct
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (rows,) = ctx.saved_tensors
        out = grad.new_zeros(ctx.m, grad.shape[1])
        write = out.index_copy_ if ctx.distinct else out.index_add_
        return write(0, rows, grad.contiguous()), None, None


class _Scatter(torch.autograd.Function):
    """Rows into a zero tensor of M rows; the gradient is the same rows of the incoming gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, rows: Tensor, m: int) -> Tensor:  # (N, F) -> (M, F)
        ctx.save_for_backward(rows)
        return x.new_zeros(m, x.shape[1]).index_copy_(0, rows, x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (rows,) = ctx.saved_tensors
        return grad.index_select(0, rows), None, None
