"""numba CPU kernels: plain functions on arrays that know nothing of models.

- qmatmul: quantized matrix x vector/matrix straight from GGUF blocks, embedding row lookup
- ops: RMSNorm, RoPE, gated activations, residual adds
- kvquant: the INT8/INT4 KV ring (quantized writes, attention reading the blocks directly)
- membw: measured read bandwidth, the yardstick for memory-bound kernels
"""
