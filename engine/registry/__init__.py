"""The prefix registry: prefixes.yaml specs, the index of entries, pinned fills."""
