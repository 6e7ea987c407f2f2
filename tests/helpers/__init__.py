"""Helpers shared by the tests: trajectory groups (`groups`), hand-made wire requests (`wire`),
waits on a condition (`wait`). Test modules import them as `helpers.<module>` (pytest puts
tests/ on the path); tests/helpers/group_step.py is a script the learner-group tests run."""
