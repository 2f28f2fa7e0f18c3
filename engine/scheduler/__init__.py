"""Which sequences run in the next step: queues, token budget, preemption."""
