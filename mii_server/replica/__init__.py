"""A replica: its gRPC servicer over the engine driver, and its tensor-parallel ranks (the only torch users of the serving wing)."""
