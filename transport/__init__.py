"""Wire: msgspec messages, ZeroMQ control channels, bulk tensor data plane."""
