//! Compiled grammars and the constraint each choice walks them with.

use std::fmt;
use std::sync::Mutex;

use anyhow::{Result, anyhow};
use lily_chat::TextTokenizer;
use lily_core::sampling_stage::{Allowed, Constraint, Grammar};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::SimpleVob;
use llguidance::{Matcher, ParserFactory, TokenParser};

use crate::vocabulary::token_env;

/// What closes Qwen's reasoning; the grammar begins after it.
const THINK_END: &str = "</think>";

/// The grammar engine for one tokenizer (its token trie and slices are built once, which takes
/// a moment at 248K tokens).
pub struct Grammars {
    factory: ParserFactory,
    think_end: u32,
    /// Tokens that end a turn: held back while the reasoning is still open.
    turn_ends: Vec<u32>,
}

impl Grammars {
    pub fn new(tokenizer: &TextTokenizer, turn_ends: Vec<u32>) -> Result<Self> {
        let mut factory = ParserFactory::new_simple(&token_env(tokenizer)?)?;
        factory.quiet();
        let think_end = tokenizer
            .token_id(THINK_END)
            .ok_or_else(|| anyhow!("the tokenizer has no {THINK_END} token"))?;
        Ok(Grammars {
            factory,
            think_end,
            turn_ends,
        })
    }

    /// `answer_lark` is a Lark grammar whose top rule is `answer`. With `thinking`, the output
    /// is free up to `</think>`, then the blank line Qwen writes, then the answer. An error
    /// here is the request's (a schema llguidance cannot compile).
    pub fn compile(&self, answer_lark: &str, thinking: bool) -> Result<CompiledGrammar> {
        let start = if thinking {
            "start: \"\\n\\n\"? answer\n"
        } else {
            "start: answer\n"
        };
        let lark = format!("{start}{answer_lark}");
        let parser = self
            .factory
            .create_parser(TopLevelGrammar::from_lark(lark))?;
        Ok(CompiledGrammar {
            parser: Mutex::new(parser),
            thinking: thinking.then(|| Thinking {
                end: self.think_end,
                turn_ends: self.turn_ends.clone(),
            }),
        })
    }
}

#[derive(Clone, Debug)]
struct Thinking {
    end: u32,
    turn_ends: Vec<u32>,
}

pub struct CompiledGrammar {
    /// The parser at its start, copied for each choice.
    parser: Mutex<TokenParser>,
    thinking: Option<Thinking>,
}

impl fmt::Debug for CompiledGrammar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompiledGrammar")
            .field("thinking", &self.thinking)
            .finish_non_exhaustive()
    }
}

impl Grammar for CompiledGrammar {
    fn start(&self) -> Result<Box<dyn Constraint>> {
        let parser = self
            .parser
            .lock()
            .map_err(|_| anyhow!("a grammar's parser was poisoned"))?
            .deep_clone();
        Ok(Box::new(GrammarWalk {
            matcher: Matcher::new(Ok(parser)),
            thinking: self.thinking.clone(),
            mask: SimpleVob::new(),
        }))
    }
}

/// One choice's place in its grammar.
pub struct GrammarWalk {
    matcher: Matcher,
    /// `Some` until the reasoning closes.
    thinking: Option<Thinking>,
    /// The last mask computed (llguidance's bit vector: one bit a token id).
    mask: SimpleVob,
}

impl Constraint for GrammarWalk {
    fn allowed(&mut self) -> Result<Allowed<'_>> {
        if let Some(thinking) = &self.thinking {
            return Ok(Allowed::Except(&thinking.turn_ends));
        }
        self.mask = self.matcher.compute_mask_or_eos()?;
        Ok(Allowed::Bits(self.mask.as_slice()))
    }

    fn advance(&mut self, token: u32) -> Result<()> {
        match &self.thinking {
            Some(thinking) if token == thinking.end => self.thinking = None,
            Some(_) => {}
            // Complete: the mask allowed only the turn's end, which ends the generation.
            None if self.matcher.is_stopped() => {}
            None => self.matcher.consume_token(token)?,
        }
        Ok(())
    }
}
