"""dreamstage's HTTP service (installed as `dreamstage.server`)."""
