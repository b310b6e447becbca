"""What a run reports: metrics and loggers, the memory report, and collective bytes."""
