//! Where weights come from: a checkpoint on disk or a synthetic generator. The weight loader
//! asks a source for tensors by canonical name and expected shape; the source checks the shape
//! and hands back f32 values, so loading code is the same for every origin.

use anyhow::Result;

use crate::weights::Linear;

pub trait TensorSource {
    /// Whether a tensor of this canonical name exists (and has not been taken yet).
    fn contains(&self, name: &str) -> bool;

    /// Takes a tensor, checking that its shape is `shape` (size-1 dims aside).
    fn take_f32(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>>;

    /// Takes the weight of a linear module as `count` matrices of `rows × cols` (a stack of
    /// experts when `count > 1`): dense `{module}.weight` (or `{module}` itself, as HF's fused
    /// expert stacks are named), or MLX-quantised `{module}.weight`, `.scales` and `.biases`.
    fn take_linears(
        &mut self,
        module: &str,
        count: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Vec<Linear>>;

    /// Fails if any tensor was left untaken: a checkpoint that does not match its config.
    fn finish(self: Box<Self>) -> Result<()>;

    /// Whether zero-centred RMSNorm weights are stored already shifted by one (MLX does this).
    fn norms_are_shifted(&self) -> bool;
}
