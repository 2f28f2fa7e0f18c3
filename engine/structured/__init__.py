"""Structured outputs: grammars compiled by llguidance, per-sequence matchers, masks."""
