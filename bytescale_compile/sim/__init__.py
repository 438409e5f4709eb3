"""Simulation: global-batch length samplers, the step simulator and per-rank timeline plots."""
