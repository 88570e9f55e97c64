"""One replica's engine core: EngineCore, the step loop, the device chain, requests and batches, options and factory."""
