"""FP8 policy, the paged cache pytree, capacity accounting, the host-side page allocator."""
