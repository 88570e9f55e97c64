"""Which module implements each role of ``deepinfer node``, and the one error when it is missing.

A role module exposes ``make_role(*, role: NodeRole, config: ClusterConfig, node_name: str)``
returning an object with ``start(node)``, ``drain(deadline_s)`` and ``stop()`` coroutines
(``runtime.node.Role``). Until a module exists, ``deepinfer node --role X`` exits 2 with a
one-line message naming what is missing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from deepinfer.runtime.cluster_config import NodeRole


@dataclass(frozen=True, slots=True)
class RoleEntry:
    module: str
    feature: str  # the issue that builds it, for the "not built yet" message


ROLE_MODULES: dict[NodeRole, RoleEntry] = {
    NodeRole.GATEWAY: RoleEntry("deepinfer.runtime.gateway.node_role", "[gateway]"),
    NodeRole.ENCODER: RoleEntry("deepinfer.runtime.encoder.node_role", "[vision]"),
    NodeRole.PREFILL: RoleEntry("deepinfer.runtime.disagg.node_role", "[pd-disagg]"),
    NodeRole.DECODE: RoleEntry("deepinfer.runtime.disagg.node_role", "[pd-disagg]"),
    NodeRole.STORAGE: RoleEntry("deepinfer.cache.store.node_role", "[kv-store]"),
}


class RoleNotBuilt(LookupError):
    pass


def role_factory(role: NodeRole) -> Callable:
    """``make_role`` of ``role``'s module, or ``RoleNotBuilt`` naming what is missing."""
    entry = ROLE_MODULES[role]
    missing = RoleNotBuilt(f"the {role.value} role of the node daemon ({entry.feature}: {entry.module}.make_role)")
    try:
        module = importlib.import_module(entry.module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and entry.module.startswith(exc.name):
            raise missing from None
        raise  # the module exists but one of its own imports is broken: show that
    factory = getattr(module, "make_role", None)
    if factory is None:
        raise missing
    return factory
