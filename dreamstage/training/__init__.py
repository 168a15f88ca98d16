"""The training half of dreamstage: jobs posted to /train, trained between decode batches.

Sub-packages by concern (the serving half is `dreamstage.serving` and `server/`):

- `jobs`: the POST /train body and the job spec, the store, submission, and the scheduler
  that runs the queue from the engine's hook;
- `pacing`: whether a micro-step may run now, how big it may be, and the idle warm-up;
- `drift`: measuring drift from the base on anchor prompts, rehearsal data, and the guard;
- `walk`: the native trainer, example rendering, prefix groups, the walk plan and receipts.

Importing this package (or any module here but `walk.trainer`) does not load the
native library.
"""
