"""KV transfer for prefill/decode disaggregation, below the engine: the interface the engine and scheduler use
(base.py), the manager that implements it (manager.py), the connectors that move blocks (connector.py: the
protocol; zmq_connector.py, nixl_connector.py), who may hand KV over (trust.py), their Prometheus metrics
(metrics.py), and the factory that builds a manager for an engine (factory.py).

The engine imports base.py and factory.py only; nothing here imports the engine, the server or the router (the
router signs hand-off params with trust.py, which loads no torch). Importing this package loads nothing.
"""
