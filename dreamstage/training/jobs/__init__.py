"""Jobs: what POST /train accepts, the frozen job spec, the SQLite store and the scheduler."""
