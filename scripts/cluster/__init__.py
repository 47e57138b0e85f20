"""The local cluster harness: every process the demo, the benchmarks and the tests start and stop.

* ``scripts.cluster.node``: ``Node``, one spawned process driven over a pipe (the agent nodes of
  the transfer, layout and GPU tests and of the transfer benchmark; stdlib only, cheap to import).
"""
