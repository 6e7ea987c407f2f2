"""Stand-ins for tests and scale benchmarks that play another role with the real components
(`drain.Drain`: a learner without a model)."""
