"""Evaluation: per-position acceptance (teacher-forced and live) on held-out workloads, and reports."""
