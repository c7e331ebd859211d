"""Front ends: the gRPC client, the REST gateway and the OpenAI-compatible server (one HTTP instrumentation)."""
