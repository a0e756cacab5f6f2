//! The parts of Lily that do not depend on a device: the model's configuration, checkpoint
//! reading, weights, synthetic models, sampling and the step-level [`backend::Backend`] trait.

pub mod backend;
pub mod checkpoint;
pub mod choice;
pub mod config;
pub mod generate;
pub mod load;
pub mod logprobs;
pub mod mlx;
pub mod model_ref;
pub mod npy;
pub mod penalties;
pub mod plan;
pub mod quant;
pub mod quantize;
pub mod rng;
pub mod safetensors_write;
pub mod sampling;
pub mod sampling_stage;
pub mod source;
pub mod synthetic;
pub mod weights;
