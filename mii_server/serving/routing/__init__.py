"""Routing: the load balancer (per-prompt round robin over replicas, retries, health)."""
