// gdn_prefill: being written.
__device__ int gdn_prefill_placeholder;
