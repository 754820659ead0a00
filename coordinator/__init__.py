"""The coordinator: registers devices, runs rounds, aggregates only what is shared."""
