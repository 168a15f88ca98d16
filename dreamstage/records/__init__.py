"""What the server served (records, `serve --record`) and what users said about it (feedback), and how
feedback becomes training (docs/architecture/feedback.md)."""
