"""Native kernels and their Python side: few-row products, the fused decoder layer and the fused feature-head step."""
