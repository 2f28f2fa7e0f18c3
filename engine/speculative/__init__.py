"""Speculative decoding without a draft model: tokens proposed from text the engine already
holds (the request's own prompt and output, earlier answers in its scope), verified by the
model in one forward."""
