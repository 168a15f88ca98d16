"""The training half of dreamstage: jobs posted to /train, trained between decode batches.

One module per concern (the serving half is `dreamstage.engine`,
`dreamstage.resident` and `server/`):

- `spec`: the POST /train body (`TrainRequest`) and the job's resolved `JobSpec`;
- `examples`: examples into token windows and loss masks (chat template, fit);
- `submit`: the submit use case (validate, render, limits, commit, enqueue);
- `store`: the job state machine and its SQLite store (jobs, receipts, adapter versions);
- `schema`: the store's SQLite schema and its migrations;
- `progress`: receipts folded into a job's progress figures;
- `walk`: the walk over a job's windows and the chunk ladder;
- `scheduler`: `DreamScheduler`, the engine's hook that runs the queue;
- `pacing`: whether a micro-step may run now (chat's bound, training's share);
- `shaper`: how big a step may be, and on how many threads (the pause);
- `served`: the adapter serving runs with; promotion, rollback, the swap;
- `adapters`: GGUF LoRA files (atomic writes);
- `receipts`: the `Receipt` dataclass mirroring `struct dream_receipt`;
- `trainer`: `Trainer`, the owner of one native dream stage.

Importing this package (or any module here but `trainer`) does not load the
native library.
"""
