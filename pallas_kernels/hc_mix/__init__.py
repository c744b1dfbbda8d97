"""The hyper-connection mix's comb matrix (MODEL.md §B.3): softmax + Sinkhorn; ops (public entry), xla and Pallas
implementations."""
