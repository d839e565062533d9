"""What a run reports: the progress line, the summary (`TrainResult`), the metrics log, traces, MFU
and memory."""
