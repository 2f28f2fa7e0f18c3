"""prefixgate gateway: OpenAI-compatible HTTP over the engine."""
