"""What a run reports: metrics and loggers, the experiment trackers, the memory report, and collective bytes."""
