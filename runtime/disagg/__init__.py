"""Prefill/decode disaggregation (ARCHITECTURE.md, "Disaggregation"): engines in separate processes or machines.

A request's path (every message is in transport/protocol.py, P/D handoff section)::

    gateway (PdEngineClient)            prefill engine                    decode engine
      pick prefill + decode  --PdDispatch-->  run prompt, 1 token
      (runtime/balance)                       copy KV to host (lease)
                                              --bulk [PdKvPush, KV]------->  hold transfer
                                              --PdKvReady----------------->  import, RUNNING
                                              <-PdHandoffAck---------------  (lease renewals
                                              free the copy                   while it waits)
             <--PdDispatchReply(HANDED_OFF)--
             <======================= PdOutput deltas (stream) =========  decode steps

Failures become messages, never silent timeouts: a decode instance's PeerDown frees the
prefill's copy at once and fails the dispatch; a prefill's PeerDown fails the gateway's wait;
leases expire; aborts go both ways. The gateway then re-dispatches (``recompute``: another
prefill, resuming after the tokens already streamed — sampling is counter-based, so the
continuation is the same) or ends the request with a clear error (``fail``).

Images (a model with a vision tower and encoder nodes, runtime/encoder/): before ``PdDispatch``
the gateway has the encoders push each image's embeddings to the prefill's embedding inbox (its
data address); the dispatch names the image spans, the KV push carries spans and embeddings on.

Modules: engine_loop (step loop), engine_service (RPC, load, links), prefill, decode, leases,
handoff_metrics, node_role (``deepinfer node --role prefill|decode``), client (the gateway's
EngineClient), local_cluster + launch (``deepinfer serve --disaggregated``).
"""
