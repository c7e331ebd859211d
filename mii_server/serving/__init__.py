"""The deployment: supervisor, load balancer, replicas, REST gateway, client, ``serve()`` / ``client()``.

Nothing here imports torch at package import; only ``replica`` (through the engine driver) does.
"""
