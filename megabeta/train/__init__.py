"""Training: the run loop, learning-rate schedules, metrics, preemption."""
