"""Prefill/decode disaggregation: KV connectors (ZeroMQ, NIXL), the engine-side hand-off bookkeeping and the
router. See connector.py for the protocol."""
