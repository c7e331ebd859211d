"""The replica's ragged batching loop: requests, scheduler, step execution, outputs."""
