"""Tensor parallelism: T ranks share one model; rank 0 schedules and broadcasts each Step over ZMQ."""
