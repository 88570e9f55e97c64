"""A forward's context in one pinned copy, and CUDA graphs of small forwards (decode steps).

A model family builds its forward context on the host: a tree of dataclasses, lists and dicts
whose leaves are index tensors, rope rows, masks and plain fields (counts, group sizes).

``pack`` lays every tensor of that tree into one pinned byte buffer, copies it to the device in
one transfer and points the tree at views of the device buffer: one host-to-device copy per
step instead of one pageable copy per tensor (~30 for a V4 decode step).

``GraphedForward`` replays forwards from CUDA graphs. A context's *signature* is its tree with
every tensor replaced by (dtype, shape) and every plain field kept: two contexts of one
signature make the model launch the same kernels on buffers of the same shapes, so a graph
captured over one replays the other once the new context's bytes are in the graph's buffer.
A signature is captured at its second sighting (the first runs eagerly and compiles the Triton
kernels of those shapes) and replayed from then on; graphs are kept LRU. The caches are the
runner's own tensors, so a replay reads and writes them in place, as an eager forward does.

Not graphed: forwards of more than ``max_tokens`` tokens (prefill chunks: their shapes rarely
repeat), contexts holding device tensors or tuples of tensors (image embeddings), a model with
forward hooks (they are Python side effects a replay would skip), and a signature whose capture
failed (an op that waits on the host): those run eagerly, and the failure is logged once.

A forward may leave tensors beside its result (``side``: V4.1's DSpark features): a capture keeps
the captured forward's, and each replay puts fresh copies of them back where the forward leaves them.

``run(..., tokens=TokenSource)``: the context's ``token_ids`` are overwritten on the device from
a device tensor (the previous step's sampled ids) after the packed copy and before the forward
or replay, on the same stream, so a decode step can be launched before the host has read the
tokens it consumes (batch.py ``TokenSource``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

log = logging.getLogger(__name__)

_ALIGN = 64  # byte alignment of each tensor in the packed buffer (Triton specialises on 16)


@dataclasses.dataclass(slots=True)
class _Leaf:
    owner: object  # dataclass instance, list or dict holding the tensor
    key: object  # field name, index or dict key
    tensor: torch.Tensor
    offset: int = 0


_TENSOR, _LIST, _DICT, _TUPLE, _PLAIN, _OTHER = range(6)
# per type: a kind above, or (qualified name, field names) of a dataclass; the walk runs every
# step, so each type is classified once
_KINDS: dict[type, object] = {}


def _kind(cls: type):
    kind = _KINDS.get(cls)
    if kind is None:
        if issubclass(cls, torch.Tensor):
            kind = _TENSOR
        elif dataclasses.is_dataclass(cls):
            kind = (cls.__qualname__, tuple(f.name for f in dataclasses.fields(cls)))
        elif issubclass(cls, list):
            kind = _LIST
        elif issubclass(cls, dict):
            kind = _DICT
        elif issubclass(cls, tuple):
            kind = _TUPLE
        elif cls is type(None) or issubclass(cls, (bool, int, float, str)):
            kind = _PLAIN
        else:
            kind = _OTHER
        _KINDS[cls] = kind
    return kind


def _walk(obj, owner, key, leaves: list[_Leaf], sig: list) -> bool:
    """Append ``obj``'s tensors to ``leaves`` and its shape to ``sig``; False if not packable."""
    kind = _KINDS.get(type(obj))
    if kind is None:
        kind = _kind(type(obj))
    if kind is _TENSOR:
        if obj.device.type != "cpu":
            return False
        leaves.append(_Leaf(owner, key, obj))
        sig.append((obj.dtype, tuple(obj.shape)))
        return True
    if kind.__class__ is tuple:  # a dataclass: (qualified name, field names)
        sig.append(kind)
        for name in kind[1]:
            if not _walk(getattr(obj, name), obj, name, leaves, sig):
                return False
        return True
    if kind is _LIST:
        sig.append(("list", len(obj)))
        for i, value in enumerate(obj):
            if not _walk(value, obj, i, leaves, sig):
                return False
        return True
    if kind is _DICT:
        sig.append(("dict", tuple(obj)))
        for k, value in obj.items():
            if not _walk(value, obj, k, leaves, sig):
                return False
        return True
    if kind is _TUPLE:
        for value in obj:
            if isinstance(value, torch.Tensor):
                return False
        sig.append(obj)
        return True
    if kind is _PLAIN:
        sig.append(obj)
        return True
    return False


def _set(leaf: _Leaf, value: torch.Tensor) -> None:
    if isinstance(leaf.owner, (list, dict)):
        leaf.owner[leaf.key] = value
    else:
        object.__setattr__(leaf.owner, leaf.key, value)  # frozen dataclasses too


@dataclasses.dataclass(slots=True)
class Layout:
    """Where each tensor of one context lies in its packed buffer."""

    leaves: list[_Leaf]
    nbytes: int
    signature: tuple | None  # None: the context holds something no graph may key on


def layout(ctx) -> Layout | None:
    """The packed layout of ``ctx``'s tensors, or None when the context cannot be packed."""
    leaves: list[_Leaf] = []
    sig: list = []
    if not _walk(ctx, None, None, leaves, sig):
        return None
    offset = 0
    for leaf in leaves:
        leaf.offset = offset
        offset += -(-leaf.tensor.nbytes // _ALIGN) * _ALIGN
    return Layout(leaves, max(offset, _ALIGN), tuple(sig))


def _fill_host(lay: Layout) -> torch.Tensor:
    # pinned blocks come from torch's caching host allocator, reused once their copy has run
    host = torch.empty(lay.nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    raw = host.numpy()  # numpy slices: a few hundred ns each, torch's views cost microseconds
    for leaf in lay.leaves:
        t = leaf.tensor
        if t.numel():
            src = t.numpy() if t.dtype is not torch.bfloat16 else t.view(torch.int16).numpy()
            raw[leaf.offset : leaf.offset + src.nbytes] = src.reshape(-1).view(np.uint8)
    return host


def _device_view(lay: Layout, device_buffer: torch.Tensor, owner, key: str) -> torch.Tensor:
    """The view of ``device_buffer`` where ``owner.key``'s tensor is packed."""
    for leaf in lay.leaves:
        if leaf.owner is owner and leaf.key == key:
            t = leaf.tensor
            return device_buffer[leaf.offset : leaf.offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    raise KeyError(f"the packed context has no tensor {key!r}")


def _point_at(lay: Layout, device_buffer: torch.Tensor) -> None:
    for leaf in lay.leaves:
        t = leaf.tensor
        n = t.numel() * t.element_size()
        _set(leaf, device_buffer[leaf.offset : leaf.offset + n].view(t.dtype).view(t.shape))


def pack(ctx, lay: Layout, device: torch.device, into: torch.Tensor | None = None, *, point: bool = True):
    """Copy ``ctx``'s tensors to ``device`` in one transfer (into ``into`` if given) and, with
    ``point``, point ``ctx`` at the device copies; returns ``ctx``."""
    host = _fill_host(lay)
    buffer = into if into is not None else torch.empty(lay.nbytes, dtype=torch.uint8, device=device)
    buffer.copy_(host, non_blocking=True)
    if point:
        _point_at(lay, buffer)
    return ctx


@dataclasses.dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    buffer: torch.Tensor  # the graph's context bytes on the device
    output: torch.Tensor  # the forward's result, rewritten by every replay
    side: object = None  # the forward's side outputs (``GraphedForward``'s ``side``), rewritten likewise


@dataclasses.dataclass(slots=True)
class GraphStats:
    replays: int = 0
    captures: int = 0
    eager: int = 0  # forwards run without a graph (first sightings, large or unpackable ones)
    failed: int = 0  # signatures whose capture failed


class GraphedForward:
    """``run(ctx)`` = ``forward(ctx)`` for a host-built context, from a CUDA graph when one fits."""

    def __init__(self, forward: Callable[[object], torch.Tensor], device: torch.device, *, max_tokens: int = 512,
                 max_graphs: int = 64, side: tuple[Callable[[], object], Callable[[object], None]] | None = None) -> None:
        """``side``: (get, put) of what a forward leaves beside its result (lists and tuples of
        tensors, e.g. a model's ``side_outputs``): a capture keeps the captured forward's, and a
        replay puts copies of them back, as an eager forward would have left them."""
        self.forward = forward
        self.side = side
        self.device = device
        self.max_tokens = max_tokens
        self.max_graphs = max_graphs
        self.stats = GraphStats()
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._seen: OrderedDict[tuple, None] = OrderedDict()
        self._failed: set[tuple] = set()
        self._pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(device)

    def run(self, ctx, num_tokens: int, graphable: bool = True, tokens=None) -> tuple[torch.Tensor, bool]:
        """(result, from a graph). A graph's result is its own buffer: read it before the next run.
        ``tokens``: a ``TokenSource`` written into ``ctx.token_ids`` on the device first."""
        lay = layout(ctx)
        if lay is None:
            self.stats.eager += 1
            ctx = _to_device(ctx, self.device)
            if tokens is not None:
                tokens.write(ctx.token_ids)
            return self.forward(ctx), False
        key = lay.signature if graphable and num_tokens <= self.max_tokens else None
        entry = self._graphs.get(key) if key is not None else None
        if entry is not None:
            self._graphs.move_to_end(key)
            pack(ctx, lay, self.device, into=entry.buffer, point=False)  # the graph reads its own views
            if tokens is not None:
                tokens.write(_device_view(lay, entry.buffer, ctx, "token_ids"))
            entry.graph.replay()
            if self.side is not None:
                self.side[1](_copies(entry.side))  # copies: the next replay rewrites the graph's
            self.stats.replays += 1
            return entry.output, True
        if key is None or key in self._failed or key not in self._seen:
            if key is not None and key not in self._failed:
                self._seen[key] = None
                if len(self._seen) > 4 * self.max_graphs:
                    self._seen.popitem(last=False)
            self.stats.eager += 1
            pack(ctx, lay, self.device)
            if tokens is not None:
                tokens.write(ctx.token_ids)
            return self.forward(ctx), False
        return self._capture(key, ctx, lay, tokens), False

    def _capture(self, key: tuple, ctx, lay: Layout, tokens=None) -> torch.Tensor:
        buffer = torch.empty(lay.nbytes, dtype=torch.uint8, device=self.device)
        pack(ctx, lay, self.device, into=buffer)
        if tokens is not None:
            tokens.write(ctx.token_ids)  # a view of ``buffer``: the captured graph reads them from there
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):  # the real forward of this step, off the capture
            result = self.forward(ctx)
        current.wait_stream(self._stream)
        result.record_stream(current)
        real_side = None if self.side is None else self.side[0]()
        graph = torch.cuda.CUDAGraph()
        rng = _default_generator(self.device)
        rng_state = rng.clone_state()  # a failed capture leaves the generator's state in capture mode
        try:
            with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
                output = self.forward(ctx)
        except RuntimeError as exc:  # an op that cannot be captured (e.g. it waits on the host)
            rng.graphsafe_set_state(rng_state)
            del graph
            self._failed.add(key)
            self.stats.failed += 1
            log.warning("forward not captured as a CUDA graph, running it eagerly: %s", str(exc).splitlines()[0],
                        exc_info=log.isEnabledFor(logging.DEBUG))
            torch.cuda.synchronize(self.device)
            if self.side is not None:
                self.side[1](real_side)
            return result
        captured_side = None
        if self.side is not None:  # the captured forward left the graph's own tensors: keep them, and
            captured_side = self.side[0]()  # give this step the real forward's
            self.side[1](real_side)
        self._graphs[key] = _Graph(graph, buffer, output, captured_side)
        self.stats.captures += 1
        if len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return result


def _copies(obj):
    """``obj`` with every tensor in it (lists and tuples, any depth) cloned."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copies(v) for v in obj)
    return obj


def shape_bucket(n: int) -> int:
    """The padded size of a count a graphed forward's shape depends on (tokens, steps, entries):
    4, 8, 12, 16, then four sizes per octave (20, 24, 28, 32, 40, 48, ..): at most 25 % more from
    16 up, about four CUDA graphs per doubling."""
    step = max(4, 1 << max(n.bit_length() - 3, 0))
    return max(4, -(-n // step) * step)


def shape_bucket_below(n: int) -> int:
    """The largest ``shape_bucket`` size at or below ``n`` (0 below 4)."""
    step = max(4, 1 << max(n.bit_length() - 3, 0))
    return n // step * step


def pads_shapes(geometry, longest_step: int) -> bool:
    """Whether a forward whose longest step has ``longest_step`` tokens pads its shapes: a decode
    or verify forward (every step <= ``merge_step_tokens``) under a geometry of a runner that
    replays graphs (``dump_block`` >= 0; V4's ``Geometry``, V4.1's wrapper of it)."""
    limit = getattr(geometry, "merge_step_tokens", 0)
    return getattr(geometry, "dump_block", -1) >= 0 and bool(limit) and longest_step <= limit


def _default_generator(device: torch.device) -> torch.Generator:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.default_generators[index]


def _to_device(ctx, device: torch.device):
    """Fallback for a context ``layout`` refuses: every CPU tensor moved on its own."""
    leaves: list[_Leaf] = []

    def walk(obj, owner, key):
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "cpu":
                leaves.append(_Leaf(owner, key, obj))
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for n in _kind(type(obj))[1]:
                walk(getattr(obj, n), obj, n)
        elif isinstance(obj, list):
            for i, v in enumerate(obj):
                walk(v, obj, i)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, obj, k)

    walk(ctx, None, None)
    for leaf in leaves:
        _set(leaf, leaf.tensor.to(device, non_blocking=True))
    return ctx

