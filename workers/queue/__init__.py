"""The queue side of the workers: request records, their fenced Lua scripts, the stage streams
and the worker loop. Nothing here imports model code; ``api/`` imports only this package."""
