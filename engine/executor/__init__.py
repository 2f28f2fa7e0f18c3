"""One forward over a batch: runner, attention, sampler, quantized linears, kernels, models."""
