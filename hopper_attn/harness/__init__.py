"""The shared harness: problems, inputs, reference, timing, baselines, results, reports."""
