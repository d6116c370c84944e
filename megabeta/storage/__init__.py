"""Checkpoint files at the storage level, below the engines that write them: durable writes
(`durable`) and reading DCP checkpoints and RNG files without running code from them
(`safe_load`)."""
