"""pdserve on Ray Serve (`pip install pdserve[ray]`): replicas of `pdserve serve` placed and restarted by Ray,
behind an OpenAI ingress deployment that routes with `pdserve router`'s code.

    config.py     the application's YAML (RayServeConfig) and its checks; imports no Ray
    replica.py    EngineReplica: one `pdserve serve` process per replica, on the replica's node address
    directory.py  ReplicaDirectory: where replicas advertise their URLs (the ingress reads it)
    ingress.py    OpenAIIngress: RouterServing (pdserve.router) over the advertised replicas
    autoscaling.py  the autoscaling policy on the engines' own signals (waiting requests, KV usage)
    metrics.py    every replica's /metrics with replica and role labels
    app.py        build_app / app_builder (`serve run pdserve.deploy.ray.app:app_builder config=...`), the CLI
"""
