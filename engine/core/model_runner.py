"""One replica's forward: the model, its block cache and SWA arena, ``execute(ForwardBatch)``.

The runner owns device memory only; which blocks and slots a sequence uses is the scheduler's
business (engine/core/batch.py draws the addressing). ``execute`` returns float32 logits
``[batch.num_logits, vocab]`` in step order (the last ``num_logits`` positions of each step;
``[0, vocab]`` when no step wants logits).

KV state export/import (host tiers, the storage cluster, SWA slot store, prefill->decode
handoff): ``kv_layout()`` describes it, ``read_blocks``/``write_blocks`` move paged blocks and
``read_slot``/``write_slot`` a sequence's SWA slot, as dicts keyed ``"<layer>.<kind>"``. Call
them between forwards (never while ``execute`` runs on another thread). The state of a
sequence that has computed ``n`` tokens is

- its logical blocks ``0 .. ceil(n / block_size) - 1``: compressed rows and indexer keys of every
  compress window that closed below ``n`` (rows of windows not yet closed are never read), and
- its slot: per layer ring ``window`` holds the K=V row of position p at row ``p % capacity``
  (a forward starting at n reads positions ``n - sliding_window + 1 .. n - 1``); per compressed
  layer ``comp_kv``/``comp_gate`` (and ``index_kv``/``index_gate`` for CSA) hold the projected
  kv/gate features of source position p at row ``p % capacity`` (a forward starting at n reads
  the open window ``r * (n // r) .. n - 1``, and for CSA also the previous window
  ``r * (n // r - 1) ..``, whose first halves overlap into the next entry).

Each ring keeps ``span + lookahead`` rows (``KvTensor.span``), so a slot read while the sequence
had computed ``n'`` tokens restores it exactly at any ``n`` in ``[n' - lookahead, n']``
(e.g. save at a block boundary ``n`` right after the forward that reached it, later restore
with ``num_computed_tokens = n`` and blocks ``0 .. n / block_size - 1``). Rows carry no
physical id: blocks and slots can be written under any ids of a runner whose ``kv_layout()``
equals the sender's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import torch
from torch.utils.hooks import RemovableHandle

from deepinfer.cache.block_cache import BlockCache
from deepinfer.cache.swa_state import SwaArena
from deepinfer import envs
from deepinfer.engine.core.batch import ForwardBatch, SeqStep
from deepinfer.engine.core.cuda_graphs import GraphedForward, pads_shapes, shape_bucket
from deepinfer.engine.kv.layout import KvLayout, KvTensor
from deepinfer.engine.models.registry import FamilyConfig, family
from deepinfer.kernels import ops


_HOST = torch.device("cpu")


class WeightsError(ValueError):
    """A state dict that does not fit the model; the message names the tensor."""


def load_weights(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], *, tied: bool = False) -> None:
    """Copy ``state_dict`` into ``model`` (converting dtypes), checking names and shapes first."""
    expected = model.state_dict()
    optional = {"lm_head.weight"} if tied else set()
    missing = sorted(set(expected) - set(state_dict) - optional)
    if missing:
        raise WeightsError(f"missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    unexpected = sorted(set(state_dict) - set(expected))
    if unexpected:
        raise WeightsError(f"unexpected tensor {unexpected[0]!r} ({len(unexpected)} unexpected in all)")
    for name, target in expected.items():
        if name not in state_dict:
            continue
        src = state_dict[name]
        if tuple(src.shape) != tuple(target.shape):
            raise WeightsError(f"tensor {name!r} has shape {tuple(src.shape)}, the model expects {tuple(target.shape)}")
    with torch.no_grad():
        for name, target in expected.items():
            if name in state_dict:
                target.copy_(state_dict[name])


QUANTIZATIONS = ("fp8",)  # --quantization


class QuantizationError(ValueError):
    """A weight quantisation this model or device cannot serve."""


def quantize_weights(model: torch.nn.Module, quantization: str, config: FamilyConfig) -> None:
    """Serve ``model``'s quantisable GEMM weights in ``quantization`` (after ``finalize``). Scales
    are powers of two (UE8M0) for a checkpoint stored in FP8 with UE8M0 scales on 128 x 128 blocks,
    so its own values come back exactly, and amax / 448 otherwise (finer; a checkpoint of smaller
    blocks cannot come back exactly in 128 x 128 ones)."""
    if quantization not in QUANTIZATIONS:
        raise QuantizationError(f"quantization must be one of {', '.join(QUANTIZATIONS)} (or none), got {quantization!r}")
    hook = getattr(model, "quantize_fp8", None)
    if hook is None:
        raise QuantizationError(f"model type {config.model_type!r} has no FP8 serving path; run it without --quantization")
    stored = getattr(config, "quantization", None) or {}
    exact = (stored.get("quant_method") == "fp8" and stored.get("scale_fmt") == "ue8m0"
             and list(stored.get("weight_block_size") or ()) == [128, 128])
    hook("ue8m0" if exact else "float")


def paged_bytes_per_block(specs, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block of ``specs`` (what ``BlockCache.bytes_per_block`` reports once built)."""
    return sum(block_size // s.ratio * s.width for s in specs) * torch.empty((), dtype=dtype).element_size()


def default_batch_invariant(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32


class ModelRunner:
    def __init__(
        self,
        config: FamilyConfig,
        state_dict: Mapping[str, torch.Tensor],
        *,
        num_blocks: int | Callable[[int], int],
        num_slots: int,
        block_size: int = 128,
        lookahead: int = 6,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_invariant: bool | None = None,
        cuda_graphs: bool | None = None,
        quantization: str | None = None,
    ) -> None:
        """``cuda_graphs``: replay decode-sized forwards from CUDA graphs (engine/core/cuda_graphs.py;
        None = on for a CUDA device unless ``DEEPINFER_CUDA_GRAPHS=0``). ``quantization="fp8"``:
        the model's FP8/FP4 GEMM weights are served as block-scaled FP8 (``model.quantize_fp8``)."""
        if lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {lookahead}")
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.batch_invariant = (
            default_batch_invariant(self.device, dtype) if batch_invariant is None else batch_invariant
        )
        model_family = family(config.model_type)  # the runner knows models only through the registry
        self._validate, self._build_context = model_family.forward_context()
        self.model = model_family.build_model(config, device=self.device, dtype=dtype)
        load_weights(self.model, state_dict, tied=config.tie_word_embeddings)
        self.model.finalize()
        if self.device.type == "cuda":
            ops.use_gpu()  # every family's CUDA tensors take the Triton kernels (kernels/gpu_routing.py)
        if quantization is not None:
            quantize_weights(self.model, quantization, config)
        self.model.eval()
        self.geometry = self.model.geometry(block_size, lookahead)
        specs = self.model.paged_specs()
        if callable(num_blocks):  # a pool sized by its budget: the bytes of one block are known only now
            num_blocks = num_blocks(paged_bytes_per_block(specs, block_size, dtype))
        self.blocks = BlockCache(specs, num_blocks=num_blocks, block_size=block_size, dtype=dtype, device=self.device)
        self.swa = SwaArena(self.model.ring_specs(lookahead), num_slots=num_slots, dtype=dtype, device=self.device)
        if cuda_graphs is None:
            cuda_graphs = envs.get().cuda_graphs
        self.graphs: GraphedForward | None = None
        if cuda_graphs and self.device.type == "cuda":
            side = None
            if hasattr(self.model, "side_outputs"):  # what a forward leaves beside its result (V4.1: DSpark's features)
                side = (lambda: self.model.side_outputs, lambda value: setattr(self.model, "side_outputs", value))
            max_tokens = envs.get().cuda_graph_max_tokens
            if max_tokens < 1:
                raise ValueError(f"DEEPINFER_CUDA_GRAPH_MAX_TOKENS must be >= 1, got {max_tokens}")
            self.graphs = GraphedForward(lambda ctx: self.model(ctx, self.blocks, self.swa), self.device, side=side,
                                         max_tokens=max_tokens)  # fmt: skip
        self.geometry = self._graph_geometry(self.geometry)
        self._modules = list(self.model.modules())
        self._hook_scan = (-1, True)  # (hook registrations seen at the last scan, its answer)

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    @property
    def num_slots(self) -> int:
        return self.swa.num_slots

    def bounded_replay(self, replay_tokens: int) -> int:
        """Tokens a bounded SWA replay recomputes (engine/kv/swa_replay.py). A model may bound only
        some layers itself (``model.bounded_replay``: V4.1's encoder replays exactly, its decoder
        layers the last ``replay_tokens``) and say how many tokens the replay needs; otherwise
        every layer replays ``replay_tokens``."""
        hook = getattr(self.model, "bounded_replay", None)
        if hook is None:
            return replay_tokens
        tokens = hook(replay_tokens)
        self.geometry = self._graph_geometry(self.model.geometry(self.blocks.block_size, self.geometry.lookahead))
        return tokens

    def _graph_geometry(self, geometry):
        """``geometry`` with the block cache's dump block where forwards replay CUDA graphs (decode
        and verify forwards then pad their closing entries, ``Geometry.dump_block``)."""
        if self.graphs is None:
            return geometry
        return with_dump_block(geometry, self.blocks.dump_block)

    # ---- KV state export / import -----------------------------------------------------------
    def kv_layout(self) -> KvLayout:
        """Names, shapes, dtypes and bytes of one block and one slot (module docstring)."""
        blocks = tuple(
            KvTensor(f"{s.layer}.{s.name}", s.layer, s.name, (self.block_size // s.ratio, s.width), self.dtype, ratio=s.ratio)
            for s in self.blocks.specs
        )
        lookahead = self.geometry.lookahead
        slots = tuple(
            KvTensor(f"{s.layer}.{s.name}", s.layer, s.name, (s.capacity, s.width), self.dtype, span=s.capacity - lookahead)
            for s in self.swa.specs
        )
        return KvLayout(self.config.model_type, self.dtype, self.block_size, lookahead, blocks, slots)

    @torch.no_grad()  # not inference_mode: the copies must be ordinary tensors for the caller
    def read_blocks(self, block_ids: Sequence[int]) -> dict[str, torch.Tensor]:
        """Host copies of blocks ``block_ids``: per block tensor ``[len(block_ids), rows, width]``."""
        return self.blocks.read_blocks(block_ids, device="cpu")

    @torch.inference_mode()
    def write_blocks(self, block_ids: Sequence[int], tensors: Mapping[str, torch.Tensor]) -> None:
        """Write tensors shaped as ``read_blocks`` returns them (any device) into blocks ``block_ids``."""
        self.blocks.write_blocks(block_ids, dict(tensors))

    @torch.no_grad()
    def read_slot(self, slot: int) -> dict[str, torch.Tensor]:
        """Host copies of slot ``slot``'s rings: per ring ``[capacity, width]``."""
        return self.swa.read_slot(slot, device="cpu")

    @torch.inference_mode()
    def write_slot(self, slot: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write rings shaped as ``read_slot`` returns them (any device) into slot ``slot``."""
        self.swa.write_slot(slot, dict(tensors))

    # ---- forward ------------------------------------------------------------------------------
    def _forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, bool]:
        """(final hidden states, whether they are a CUDA graph's output buffer)."""
        self._validate(batch, self.geometry, self.swa.num_slots)
        tokens = batch.token_source
        if tokens is not None:
            self._check_token_source(batch)
        if self.graphs is None:
            ctx = self._build_context(batch, self.geometry, device=self.device, batch_invariant=self.batch_invariant)
            if tokens is not None:
                tokens.write(ctx.token_ids)
            return self.model(ctx, self.blocks, self.swa), False
        padded = self._graph_batch(batch)
        ctx = self._build_context(padded, self.geometry, device=_HOST, batch_invariant=self.batch_invariant)
        hidden, replayed = self.graphs.run(ctx, padded.num_tokens, graphable=not self._has_hooks(), tokens=tokens)
        if padded is not batch:
            hidden = hidden[: batch.num_logits]  # the padding steps' rows come last
        return hidden, replayed

    def _graph_batch(self, batch: ForwardBatch) -> ForwardBatch:
        """``graph_batch`` with this runner's geometry, dump slot and block, and graph size limit."""
        return graph_batch(batch, self.geometry, self.swa.dump_slot, self.blocks.dump_block, self.graphs.max_tokens)

    def _has_hooks(self) -> bool:
        """Whether a module of the model has forward hooks (a graph replay would skip them). Every
        hook registration takes the next id of torch's ``RemovableHandle``: while none happened
        since a scan that found none, there are none (V4-Flash's 43 layers are ~1,100 modules:
        ~0.1 ms of every decode step's host time on the 2-core VM). Once hooked, every call looks
        again (a removed hook is seen at once)."""
        registered = RemovableHandle.next_id
        seen, hooked = self._hook_scan
        if registered != seen or hooked:
            hooked = any(m._forward_hooks or m._forward_pre_hooks for m in self._modules)
            self._hook_scan = (registered, hooked)
        return hooked

    def _check_token_source(self, batch: ForwardBatch) -> None:
        """Device-fed ids are for decode batches: one token per step (no model sub-batch then
        re-slices the tokens), destinations inside the batch, ids on this runner's device."""
        src = batch.token_source
        if any(len(s.token_ids) != 1 for s in batch.steps):
            raise ValueError("ForwardBatch.token_source needs a batch of single-token steps (decode)")
        if src.dst and not 0 <= min(src.dst) <= max(src.dst) < len(batch.steps):
            raise ValueError(f"ForwardBatch.token_source: destination outside the batch's {len(batch.steps)} tokens")
        if src.tokens.device.type != self.device.type or src.tokens.dim() != 1:
            raise ValueError(f"ForwardBatch.token_source: ids must be a 1-D tensor on {self.device}, "
                             f"got {tuple(src.tokens.shape)} on {src.tokens.device}")

    @torch.inference_mode()
    def execute_hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """Final hidden states ``[num_logits, hidden]`` (the seam for speculative decoding)."""
        hidden, replayed = self._forward(batch)
        return hidden.clone() if replayed else hidden

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        hidden, _ = self._forward(batch)  # a graph's buffer is read here, before the next forward
        return self.model.compute_logits(hidden, self.batch_invariant)


def with_dump_block(geometry, block: int):
    """A family's geometry (a dataclass, or one wrapping its base as ``base``) with its
    ``dump_block`` field set; a geometry without that field is returned as it is."""
    if not dataclasses.is_dataclass(geometry):
        return geometry
    names = {f.name for f in dataclasses.fields(geometry)}
    if "dump_block" in names:
        return dataclasses.replace(geometry, dump_block=block)
    if "base" in names:
        return dataclasses.replace(geometry, base=with_dump_block(geometry.base, block))
    return geometry


PAD_FROM = 4  # graphed decode / verify batches of more tokens are padded (graph_batch)


def graph_batch(batch: ForwardBatch, geometry, dump_slot: int, dump_block: int, max_tokens: int) -> ForwardBatch:
    """A decode or verify batch of a graphed runner whose geometry pads (``pads_shapes``:
    ``dump_block`` >= 0, every step <= ``merge_step_tokens``) with padding steps appended up to
    ``shape_bucket`` tokens: each one token at position 0 of the ring arena's dump slot, its block
    table the block cache's dump block, one logit row (cut off after the forward). So the token
    count, and with the geometry's padded entries and step pools the CUDA-graph signature, stays
    put while requests join and leave. Batches of up to ``PAD_FROM`` tokens stay as they are (few shapes;
    a padding token would route to experts a batch-1 decode does not read); so does one over
    ``max_tokens`` padded (not graphed)."""
    tokens = batch.num_tokens
    if tokens <= PAD_FROM or not pads_shapes(geometry, max(s.num_tokens for s in batch.steps)):
        return batch
    target = shape_bucket(tokens)
    if target == tokens or target > max_tokens:
        return batch
    pad = [SeqStep(-1 - i, dump_slot, [dump_block], 0, [0], num_logits=1) for i in range(target - tokens)]
    return ForwardBatch(list(batch.steps) + pad, token_source=batch.token_source)
