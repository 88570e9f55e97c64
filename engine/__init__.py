"""One replica's compute, in rooms by responsibility: api, core, sched, sample, text, kv, loader,
models, spec, parallel (ARCHITECTURE.md, "Folder map")."""
