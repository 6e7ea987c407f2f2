"""Helpers shared by the tests; test modules import them as `helpers.<module>` (pytest puts tests/
on the path, and `procs.child_env` puts it on a child's PYTHONPATH).

groups: trajectory groups (`make_group`, `group_of`). wire: hand-made requests to a ROUTER
server (`RawPeer`, `raw_request`). wait: waits on a condition (`wait_until`, `running`).
lifetime: factory fixtures that close what they made (`closing_all`). procs: child processes
the `process_reaper` fixture cleans up (`start`, `child_env`). runs: `sluice run` from the
end-to-end tests. weight_sync_env: a learner's weight-sync side in the test process. engines:
learner log-probs for engine tests, mid-generation weight updates. bench_scripts: benchmark
smoke runs. netns: hosts at addresses of their own (network namespaces), processes in them.
group_step.py and sharded_publisher.py are scripts that tests run as processes.
"""
