"""The hyper-connection mix's comb matrix (MODEL.md §B.3): softmax + Sinkhorn, XLA and Pallas implementations."""
