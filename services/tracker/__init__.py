"""The tracker service: prompt evidence, leases, the sampler and the policy clock, all in Redis."""
