"""KV state as the engine moves it: block/slot manager, layout, offload tiers, handoff export/import, SWA slots."""
