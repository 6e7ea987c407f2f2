"""An example Sluice plugin package (docs/extending.md): `task.FirstDigitTask`, the rewards in
`rewards`, the loss in `loss`. Each module imports only Sluice's public plugin interfaces, so
each also works by file reference (`path/to/task.py:FirstDigitTask`)."""
