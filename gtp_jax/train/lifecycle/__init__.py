"""A run's lifecycle: checkpoints (and their array layout and checksums), resuming, warm starts,
stopping on a signal, the directory lock, training on through a device failure."""
