"""The PD disaggregation router (`pdserve router`, and the Ray Serve ingress): an HTTP front that runs each request's
prompt on a prefill instance and its decode on a decode instance. app.py (routes, command line), serving.py (the
hand-off, retries, streaming relay), pool.py (instances, health, least-loaded choice), prefix.py and prompt_tokens.py
(the prefix-aware choice, the prompt's tokens), stats.py (the dashboard's /v1/stats), metrics.py (Prometheus, request
log).

It shares only torch-free pieces: pdserve.api (errors, guards, request models, dashboard page) and
pdserve.kv_transfer.trust (signing), and pdserve.prefix_hash (the engine's block hashes). It imports neither the server,
the engine, the model nor torch.
"""
