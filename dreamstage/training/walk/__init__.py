"""The walk: the native trainer, examples rendered into windows, prefix groups, the plan and receipts."""
