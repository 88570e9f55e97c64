"""Expert-parallel engine groups as processes: ``engine_group.py`` (N rank processes behind one
``EngineClient``, for ``deepinfer serve --ep N``), ``node_group.py`` (ranks 1..N-1 behind a P/D
engine node whose own engine is rank 0, for ``deepinfer node --role prefill|decode --ep N``) and
``rank_worker.py`` (one rank). The EP math itself (dispatch/combine, replicas, re-placement) is
engine/parallel/; this room owns the processes and their wire (transport/protocol/ep.py), which
the engine layer may not import."""
