// attention_prefill: being written.
__device__ int attention_prefill_placeholder;
