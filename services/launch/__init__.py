"""`spopp launch` and `spopp ablate`: a whole run (tracker, replicas, learner, evaluator) on one machine."""
