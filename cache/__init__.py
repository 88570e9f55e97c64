"""All KV state: block pool + prefix index, SWA slots, host tier, storage cluster."""
