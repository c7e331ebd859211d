"""Per-request generation: parameters, sampling, stopping, detokenisation, responses."""
