"""Pacing: whether a micro-step may run now (chat's bound, training's share), its size and threads."""
