"""Benchmark scripts: each prints a table and writes JSON (docs/results/ holds the published runs)."""
