"""The run of one request: its attempts on workers, the relay, deltas, stop strings, choices, deadlines."""
