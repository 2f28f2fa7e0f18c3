"""Plain data at the bottom of the engine: errors, config, CPU facts, sampling
parameters, sequences and outputs. Imports nothing else of the engine."""
