"""Reliability suite: crash consistency, fault injection, corruption, concurrency, hostile input."""
