"""The training step: `TrainStep` (the one jitted step over the split state), the optimizer the
trainer builds, and the memory bound a run is checked against before it is built."""
