//! Text around the engine: the tokenizer with incremental detokenisation, the chat template,
//! stop strings, and the parser that splits streamed output into reasoning, answer and tool calls.

pub mod assets;
mod cuts;
pub mod detok;
pub mod output;
mod recent;
pub mod stop;
pub mod template;
pub mod text_stream;
pub mod tokenizer;
pub mod tool_schema;

pub use assets::TextModel;
pub use output::{ChatDelta, ChatOutputParser};
pub use stop::{StopMatcher, StopStep};
pub use template::ChatTemplate;
pub use text_stream::TextStream;
pub use tokenizer::TextTokenizer;
pub use tool_schema::ToolSchemas;
