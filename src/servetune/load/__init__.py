"""Load generation: workload -> request stream -> async streaming client -> records.

Knows nothing of Ray or MLflow.
"""
