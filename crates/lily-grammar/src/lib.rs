//! Constrained decoding: what a request's output must follow (`response_format`'s JSON object or
//! JSON Schema, a forced tool call in Qwen's XML format), as grammars of llguidance, the engine
//! llama.cpp and vLLM use. A [`Grammars`] is made once per tokenizer; each request compiles its
//! grammar from it (a bad schema is an error then, before any token), and each choice walks it
//! with a [`lily_core::sampling_stage::Constraint`] of its own.
//!
//! Thinking: when the prompt opens a `<think>` block, the reasoning is left free and the grammar
//! starts after `</think>` (as vLLM's reasoning parsers do); until then the turn cannot end, so
//! a reply always carries its constrained answer or stops at `max_tokens` ("length").

mod constraint;
mod format;
mod tool_call;
mod vocabulary;

pub use constraint::{CompiledGrammar, Grammars};
pub use format::OutputFormat;
pub use tool_call::{ToolCallError, tool_call_lark};
