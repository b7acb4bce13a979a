"""Metrics records, their sinks, and reports."""
