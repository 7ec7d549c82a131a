"""The agent runtime: what plays an episode, shared by rollout replicas and the evaluator.

Engines (vLLM, transformers), chat rendering, the multi-turn agent loop, environments, the
sandbox for model-written code, the answer verifier and task loading. It sits between the
library (`spopp`: math, wire schemas, client) and the services, and imports no service: a
replica and the evaluator both build on it without importing each other.
"""
