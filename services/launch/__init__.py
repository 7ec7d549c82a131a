"""`spopp launch` (a whole run on one machine: tracker, replicas, learner, evaluator) and `spopp scale`."""
