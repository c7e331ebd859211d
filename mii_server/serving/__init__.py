"""The serving wing, torch-free: control plane, routing and front ends, with the gRPC, error-status,
metrics and logging plumbing they share. The replica (``mii_server.replica``) is the only part of a
deployment that imports torch; ``tests/server/test_imports.py`` walks this folder to hold that rule.
"""
