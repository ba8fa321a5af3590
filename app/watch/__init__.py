"""Watching a run: reading its event topics, the run monitor and its books, metrics.jsonl and
curves, status and tail, the metric exporters and the live dashboard."""
