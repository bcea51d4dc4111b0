"""A discrete-event simulator of a kvserve cluster: real engines and real placement, virtual time.

Each simulated worker runs the real LLMEngine (scheduler, allocator, preemption) with a
runner that computes nothing and instead prices each step with a cost model fitted to
the real engine; the router side reuses router.placement's WorkerView and policies.
"""
