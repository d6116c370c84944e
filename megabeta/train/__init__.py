"""Training: config, loop, optimizer, metrics, preemption."""
