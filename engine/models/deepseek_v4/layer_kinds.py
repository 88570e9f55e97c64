"""Per-layer kinds of a V4 model: attention (window-only, CSA, HCA) and MoE routing (hash, learned).

Read from transformers' ``layer_types`` + ``compress_rates`` and ``mlp_layer_types``, or from
DeepSeek's ``compress_ratios`` (one ratio per layer: 0 window-only, 4 CSA, others HCA; extra
trailing entries belong to MTP layers) and ``num_hash_layers`` (the first N layers hash-route).
"""

from __future__ import annotations

from collections.abc import Mapping

from deepinfer.engine.loader.config_fields import FieldReader

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
HASH_MOE = "hash_moe"
MOE = "moe"

LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = (HASH_MOE, MOE)

# The compression ratio DeepSeek's code gives overlapping windows and an indexer (= CSA).
NATIVE_CSA_RATIO = 4


def parse_layer_kinds(r: FieldReader, num_layers: int) -> tuple[dict[str, int], tuple[str, ...]]:
    """(compress rate per compressed kind, attention kind per layer)."""
    rates = {CSA: 4, HCA: 128}
    explicit_rates = r.get("compress_rates")
    if explicit_rates is not None:
        if not isinstance(explicit_rates, Mapping) or set(explicit_rates) - {CSA, HCA}:
            r.fail("compress_rates", f"must map {CSA!r}/{HCA!r} to ratios, got {explicit_rates!r}")
        for kind, value in explicit_rates.items():
            rates[kind] = r.positive_int_value(f"compress_rates.{kind}", value)
    for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        rates[kind] = r.int(legacy, rates[kind])

    if r.has("layer_types"):
        types = r.str_list("layer_types")
        for i, t in enumerate(types):
            if t not in LAYER_TYPES:
                r.fail(f"layer_types[{i}]", f"is {t!r}; expected one of {', '.join(LAYER_TYPES)}")
        if len(types) != num_layers:
            r.fail("layer_types", f"has {len(types)} entries for {num_layers} layers")
        return rates, tuple(types)

    if r.has("compress_ratios"):
        ratios = r.int_list("compress_ratios", minimum=0)
        if len(ratios) < num_layers:
            r.fail("compress_ratios", f"has {len(ratios)} entries for {num_layers} layers")
        ratios = ratios[:num_layers]  # trailing entries describe MTP layers
        if explicit_rates is None:
            rates[CSA] = NATIVE_CSA_RATIO
            hca_ratios = sorted({x for x in ratios if x not in (0, NATIVE_CSA_RATIO)})
            if len(hca_ratios) > 1:
                r.fail("compress_ratios", f"mixes HCA ratios {hca_ratios}; all non-CSA compressed layers "
                       "must share one ratio")
            if hca_ratios:
                rates[HCA] = hca_ratios[0]
        if rates[CSA] == rates[HCA]:
            r.fail("compress_rates", f"gives CSA and HCA the same ratio {rates[CSA]}; compress_ratios is ambiguous")
        ratio2type = {0: SLIDING, rates[HCA]: HCA, rates[CSA]: CSA}
        types = []
        for i, x in enumerate(ratios):
            if x not in ratio2type:
                r.fail(f"compress_ratios[{i}]", f"is {x}; compress_rates allow {sorted(ratio2type)}")
            types.append(ratio2type[x])
        return rates, tuple(types)

    # transformers' default schedule: two HCA layers, then HCA/CSA interleaved.
    interleave = [CSA if i % 2 else HCA for i in range(max(num_layers - 2, 0))]
    return rates, tuple(([HCA] * min(num_layers, 2) + interleave)[:num_layers])


def parse_mlp_kinds(r: FieldReader, num_layers: int) -> tuple[str, ...]:
    """MoE routing kind per layer."""
    if r.has("mlp_layer_types"):
        types = r.str_list("mlp_layer_types")
        for i, t in enumerate(types):
            if t not in MLP_LAYER_TYPES:
                r.fail(f"mlp_layer_types[{i}]", f"is {t!r}; expected one of {', '.join(MLP_LAYER_TYPES)}")
        if len(types) != num_layers:
            r.fail("mlp_layer_types", f"has {len(types)} entries for {num_layers} layers")
        return tuple(types)
    num_hash = min(r.int("num_hash_layers", 3, minimum=0), num_layers)
    return (HASH_MOE,) * num_hash + (MOE,) * (num_layers - num_hash)
