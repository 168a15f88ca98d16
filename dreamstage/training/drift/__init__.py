"""Drift: the base's answers on anchor prompts, how far an adapter moves them, and the guard."""
