"""The serving path: socket, protocol core, admission gate, stream sessions, the engine channel and their
metrics. One request passes through transport -> gate -> app -> session -> engine (docs/architecture.md)."""
