// moe_prefill: being written.
__device__ int moe_prefill_placeholder;
