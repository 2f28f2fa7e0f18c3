"""From a model spec to weights in memory: sources, GGUF blocks, safetensors, caches."""
