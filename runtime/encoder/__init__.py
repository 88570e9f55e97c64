"""The vision-encoder (VE) pool: images encoded on encoder nodes, their embeddings pushed to the
prefill engine on the data plane (SPEC sections 2, 5, 6).

    gateway (EncoderPool)                 encoder node (EncoderService)        prefill (EmbeddingInbox)
      prepare + price images (Pillow)
      pick an encoder per image  --VeEncode + pixels-->  tower
      (VE balancer: pending tokens)                      --bulk [VeEmbeds, embeddings]-->  held by key
            <--VeEncoded------------------------------  (after the inbox has them)
      dispatch the request to the prefill               ...                        take(key) -> engine

Failures: the pool probes every encoder (``VeStatusRequest``); one that stops answering is down,
its images in flight are encoded again on the others (the push is idempotent: the inbox keeps the
last copy of a key), and it takes no new images until it answers again.

Modules: service (the encoder node's role), node_role (``deepinfer node --role encoder``), pool
(the gateway side), inbox (the prefill side). Messages: transport/protocol/ve.py.
"""
