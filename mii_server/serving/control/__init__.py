"""Control plane: serve() and client(), the supervisor, the registry, the deployment config, ports, devices."""
